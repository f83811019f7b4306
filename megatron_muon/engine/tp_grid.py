"""tp_mode ``"layer_sharded"``: the DP x TP grid as the owner pool of tensor-parallel matrices.

Under tensor parallelism a weight's unsplit matrix is spread over a grid of ranks: its ``tp``
partitions (``Shard(partition_dim)`` on the DTensor's tensor-parallel mesh axis: the ranks of
``pg_collection.tp``, ``expt_tp`` for experts) and, within each partition, its row shards over
the data-parallel group (``dp_cp``, ``expt_dp``). ``duplicated`` has every TP rank gather the
whole matrix and run the same NS (TP times the work); ``layer_sharded`` (Megatron-LM's name, from
its open PR #6676/#6683) makes the whole grid one owner pool: each unsplit matrix is assembled on
one owner rank of the grid from every rank's rows, orthogonalized once with
``TensorParallelMuon``'s own NS (no collective inside NS), and each rank gets its rows back.
Bitwise the update of ``duplicated`` (the same full matrix, the same NS call, the same scale),
except for the matrices whose NS the plan splits over several grid ranks (below).

How it reuses the row exchange (``exchange.OwnerExchange``), the planner and the buckets: every
2-D param gets a *stacked* matrix whose row layout over the grid group is known from the
DTensors' metadata alone:

- a TP-split param: its ``tp`` partitions stacked along rows, ``(tp * rows, cols)`` with
  partition ``t`` at rows ``[t * rows, (t + 1) * rows)``. For ``partition_dim == 0`` (column
  parallel: QKV, fc1, embedding) that *is* the unsplit matrix; for ``partition_dim == 1`` (row
  parallel: proj, fc2) the unsplit matrix is the partitions side by side
  (``join_partitions``), made on the owner before NS and undone after (``stack_partitions``);
- a param not split by TP (router, a TP-replicated weight): its matrix, held by the TP ranks of
  a row shard alike (replicas, as HSDP's outer replicas are).

Grid rank ``g`` of a stacked matrix holds rows ``[t_g * rows + start, t_g * rows + stop)`` where
``(start, stop)`` are its rows of partition ``t_g`` (``layout.gather_row_layouts``): a
``RowLayout`` over the grid group, gathered once (one small ``all_gather`` over the grid).

- ``grid_ranks``: the grid of an optimizer's params (None where no param is split by TP);
- ``GridLayouts.gather``: the grid group, and each param's stacked layout and TP partitions;
- ``join_partitions`` / ``stack_partitions``: stacked <-> unsplit matrix (pure);
- ``orthogonalize_unsplit``: NS of the unsplit matrix with Q, K and V apart under QKV split;
- ``row_parallel_split_blocks``: where the blocks of a split NS (``split_newton_schulz``) of a
  row-parallel unsplit matrix lie in its stacked matrix (pure).

Splitting a matrix's NS over a block of grid ranks (above the split threshold,
``planner.plan_split_owners``) runs ``split_newton_schulz`` on blocks of the unsplit matrix along
its long dim, as the data-parallel owner step splits. For a column-parallel matrix the stacked
matrix is the unsplit one, so its blocks are its own. For a row-parallel one (wide or square:
split by columns) each block is a rectangle of the stacked matrix where it lies in one partition
or is made of whole partitions (``row_parallel_split_blocks``); such a block's partitions are
joined side by side before the split NS and stacked again after. A split NS sums its Gram
matrices over the block's ranks, so it equals ``duplicated``'s NS to the reduction order only;
every matrix whose NS is not split is bitwise ``duplicated``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_muon.engine.layout import (
    RowLayout,
    TensorParallelSplit,
    all_gather_single,
    group_ranks,
    mesh_axes,
    new_member_group,
    ranks_along,
)
from megatron_muon.engine.qkv import join_qkv, split_qkv
from megatron_muon.newton_schulz.cost_model import split_bounds

__all__ = [
    "GridLayouts",
    "grid_ranks",
    "join_partitions",
    "orthogonalize_unsplit",
    "row_parallel_split_blocks",
    "stack_partitions",
]


def _split_of(param: torch.Tensor, dp_ranks: Sequence[int]) -> TensorParallelSplit | None:
    """The TP split of a DTensor param split by tensor parallelism, else None."""
    if not isinstance(param, DTensor):
        return None
    axes = mesh_axes(param, dp_ranks)
    return axes.tensor_parallel[0] if axes.tensor_parallel else None


def grid_ranks(
    params: Sequence[torch.Tensor], dp_group: dist.ProcessGroup | None
) -> tuple[int, ...] | None:
    """Global ranks (sorted) of the DP x TP grid of the TP-split params among ``params``: the
    ranks of their mesh's data-parallel axes and tensor-parallel axis through this rank. Metadata
    only: no collective.

    Returns:
        None when no param is split by tensor parallelism (``layer_sharded`` is then
        ``duplicated``: every matrix is whole on its data-parallel group).

    Raises:
        ValueError: two TP-split params on different grids, naming the second.
    """
    dp_ranks = group_ranks(dp_group)
    grid: tuple[int, ...] | None = None
    first = -1
    for index, param in enumerate(params):
        if not isinstance(param, DTensor) or (split := _split_of(param, dp_ranks)) is None:
            continue
        axes = mesh_axes(param, dp_ranks)
        ranks = tuple(sorted(ranks_along(param, [*axes.data_parallel, split.axis])))
        if grid is None:
            grid, first = ranks, index
        elif ranks != grid:
            raise ValueError(
                f"tp_mode='layer_sharded': param {index} of shape {tuple(param.shape)} spans "
                f"the DP x TP grid of ranks {list(ranks)}, param {first} that of ranks "
                f"{list(grid)}: one optimizer orthogonalizes over one grid; use 'duplicated'"
            )
    return grid


@dataclass(frozen=True, slots=True)
class GridLayouts:
    """The grid group and every param's stacked matrix over it (module docstring).

    Attributes:
        group: the process group of the grid's ranks (created here, members only).
        size: ranks in ``group``.
        layouts: each 2-D param's stacked-matrix ``RowLayout`` over ``group`` (group rank
            order); a 3-D param's own layout over its data-parallel group (never exchanged).
        partitions: each param's ``(tp partitions, partition_dim)``; ``(1, 0)`` when not split.
    """

    group: dist.ProcessGroup
    size: int
    layouts: list[RowLayout]
    partitions: list[tuple[int, int]]

    @staticmethod
    def gather(
        params: Sequence[torch.Tensor],
        dp_group: dist.ProcessGroup | None,
        dp_layouts: Sequence[RowLayout],
        ranks: Sequence[int],
    ) -> GridLayouts:
        """Creates the grid group of ``ranks`` and gathers each param's stacked layout over it.

        Args:
            params: the optimizer's params, in the same order on every rank of the grid.
            dp_group: their data-parallel group (this rank's row shards, ``dp_layouts``).
            dp_layouts: each param's tensor-parallel-local layout over ``dp_group``.
            ranks: the grid (``grid_ranks``), this rank among them.

        Collective over the grid's ranks (``new_group`` with local synchronization, so grids of
        other pipeline stages or expert groups need not take part, and one ``all_gather``).
        """
        group = new_member_group(list(ranks))
        size = len(ranks)
        dp_ranks = group_ranks(dp_group)
        dp_rank = dist.get_rank(dp_group) if dist.get_world_size(dp_group) > 1 else 0
        me = dist.get_rank()
        mine, partitions = [], []
        for param, layout in zip(params, dp_layouts, strict=True):
            split = _split_of(param, dp_ranks) if param.ndim == 2 else None
            tp_index = split.ranks.index(me) if split is not None else 0
            partitions.append((len(split.ranks), split.dim) if split is not None else (1, 0))
            mine.append([tp_index, *layout.ranges[dp_rank]])
        described = torch.tensor(mine, dtype=torch.int64).reshape(len(params), 3)
        gathered = torch.empty(size * len(params), 3, dtype=torch.int64)
        all_gather_single(gathered, described, group=group)
        table = gathered.view(size, len(params), 3).tolist()
        layouts = []
        for i, (layout, (count, _)) in enumerate(zip(dp_layouts, partitions, strict=True)):
            if params[i].ndim != 2:  # 3-D expert tensors: whole experts per rank, no exchange
                layouts.append(layout)
                continue
            rows = layout.num_rows
            ranges = tuple(
                (t * rows + start, t * rows + stop) for t, start, stop in (r[i] for r in table)
            )
            layouts.append(RowLayout(count * rows, layout.row_shape, ranges))
        return GridLayouts(group, size, layouts, partitions)


def join_partitions(stacked: torch.Tensor, partitions: int, dim: int) -> torch.Tensor:
    """The unsplit matrix of a stacked one ``(partitions * rows, cols)``: itself for
    ``dim == 0``, the partitions side by side ``(rows, partitions * cols)`` for ``dim == 1``
    (what ``TensorParallelMuon``'s ``duplicated`` all-gathers and concatenates)."""
    if dim == 0 or partitions == 1:
        return stacked
    return torch.cat(stacked.chunk(partitions, dim=0), dim=1)


def stack_partitions(unsplit: torch.Tensor, partitions: int, dim: int) -> torch.Tensor:
    """The inverse of ``join_partitions``."""
    if dim == 0 or partitions == 1:
        return unsplit
    return torch.cat(unsplit.chunk(partitions, dim=1), dim=0)


def orthogonalize_unsplit(
    scaled_orthogonalize: Callable[[torch.Tensor], torch.Tensor],
    unsplit: torch.Tensor,
    qkv_split_shapes: Sequence[int],
) -> torch.Tensor:
    """NS with Muon's scale of an unsplit ``(rows, cols)`` fp32 matrix, Q, K and V apart under
    QKV split (``qkv_split_shapes`` non-empty), as ``TensorParallelMuon.orthogonalize`` under
    ``duplicated`` computes it: its query groups of every TP partition in partition order are the
    unsplit matrix's, so each of Q, K and V is the very matrix it all-gathers.

    Args:
        scaled_orthogonalize: NS and scale of one whole matrix (``TensorParallelMuon``'s
            ``scaled_orthogonalize_fn`` without a TP group).
    """
    if not qkv_split_shapes:
        return scaled_orthogonalize(unsplit)
    pieces = split_qkv(unsplit, qkv_split_shapes)
    return join_qkv([scaled_orthogonalize(piece) for piece in pieces], qkv_split_shapes)


def row_parallel_split_blocks(
    rows: int, cols: int, partitions: int, num_parts: int
) -> list[tuple[int, int, int, int]] | None:
    """Where each block of a split NS of a row-parallel unsplit matrix lies in its stacked matrix.

    The unsplit matrix ``(rows, partitions * cols)`` is split by columns into
    ``split_bounds(partitions * cols, num_parts)``; partition ``t`` is rows
    ``[t * rows, (t + 1) * rows)`` of the stacked ``(partitions * rows, cols)`` matrix. Pure.

    Returns:
        ``(row_start, row_stop, col_start, col_stop)`` in the stacked matrix of each block: a
        column range of one partition, or whole partitions ``t0 .. t1 - 1`` (rows
        ``[t0 * rows, t1 * rows)``, every column; ``join_partitions`` of its ``t1 - t0``
        partitions is the block). None where a block is neither, or is empty.
    """
    blocks = []
    for lo, hi in split_bounds(partitions * cols, num_parts):
        if hi <= lo:
            return None
        first, last = lo // cols, (hi - 1) // cols
        if first == last:
            blocks.append((first * rows, (first + 1) * rows, lo - first * cols, hi - first * cols))
        elif lo % cols == 0 and hi % cols == 0:
            blocks.append((first * rows, (last + 1) * rows, 0, cols))
        else:
            return None
    return blocks

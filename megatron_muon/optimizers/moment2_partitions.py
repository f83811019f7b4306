"""AdaptiveMuon's normuon / namo second moment per tensor-parallel partition, as megatron-core's.

megatron-core's ``TensorParallelAdaptiveMuon`` steps each TP rank's partition of a TP-split matrix
as a matrix of its own (``AdaptiveMuon.step`` on the TP-local param): normuon averages the
squared raw NS result of the **partition** along the partition's longer side (per row when its
rows >= its cols, else per column), keeps a ``(rows_p, 1)`` / ``(1, cols_p)`` state and matches
the partition's Frobenius norm; namo keeps a ``(1,)`` state of the partition's squared gradient
norm and scales by the partition's pre-NS norm. Each TP rank holds its own partition's state.

``ShardedAdaptiveMuon`` holds that state for **every** partition, on every rank of the param's
DP x TP grid alike (a plain tensor, so a checkpoint keeps one copy and it reloads at any DP size):
the ``count`` partition states stacked along dim 0, partition ``t`` (the ``t``-th rank along the
TP mesh axis) in rows ``t * r : (t + 1) * r``. normuon: ``(count * rows_p, 1)`` or
``(count, cols_p)``; namo: ``(count,)``. A param that tensor parallelism does not split has
``count == 1``: AdaptiveMuon's own shapes.

After each step the ranks that computed a partition's new state (its owner, or every rank of its
TP coordinate for namo) send it to all others with ``share_states``: an all_reduce MAX over
``dp_group``, then over each TP group, the other ranks contributing ``-1`` (states are
non-negative: averages of squares), so each value is copied exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_muon.engine.layout import group_ranks, mesh_axes

__all__ = ["Partitions", "partitions_of", "share_states", "state_shape"]

# What a rank that did not compute a block contributes to the MAX (states are >= 0).
_NOT_COMPUTED = -1.0


@dataclass(frozen=True, slots=True)
class Partitions:
    """How tensor parallelism splits a 2-D param.

    Attributes:
        count: TP partitions (1: not split).
        index: this rank's partition (its place along the TP mesh axis).
        rows, cols: one partition's shape (Megatron splits evenly).
        group: the ranks along the param's tensor-parallel mesh axis (holding the partitions,
            or replicas of an unsplit param); None without one.
    """

    count: int
    index: int
    rows: int
    cols: int
    group: dist.ProcessGroup | None


def partitions_of(param: torch.Tensor, dp_group: dist.ProcessGroup | None) -> Partitions:
    """The TP split of ``param``: a DTensor's tensor-parallel mesh axis (``layout.mesh_axes``;
    one that replicates the param gives ``count == 1`` and its group), a plain tensor unsplit."""
    rows, cols = param.shape[-2:]
    if not isinstance(param, DTensor):
        return Partitions(1, 0, rows, cols, None)
    axes = mesh_axes(param, group_ranks(dp_group))
    if not axes.tensor_parallel:
        mesh = param.device_mesh
        others = [a for a in range(mesh.ndim) if a not in axes.data_parallel and mesh.size(a) > 1]
        group = mesh.get_group(others[0]) if len(others) == 1 else None
        return Partitions(1, 0, rows, cols, group)
    (split,) = axes.tensor_parallel  # mesh_axes refuses more than one
    count = len(split.ranks)
    shape = [rows, cols]
    shape[split.dim] //= count
    index = split.ranks.index(dist.get_rank())
    group = param.device_mesh.get_group(split.axis)
    return Partitions(count, index, shape[0], shape[1], group)


def state_shape(method: str, parts: Partitions) -> tuple[int, ...]:
    """The stacked per-partition state's shape (module docstring) for normuon or namo."""
    if method == "namo":
        return (parts.count,)
    if parts.rows >= parts.cols:  # AdaptiveMuon's avg_dim -1, on the partition's shape
        return (parts.count * parts.rows, 1)
    return (parts.count, parts.cols)


def share_states(
    states: Sequence[torch.Tensor],
    computed: Sequence[Sequence[int]],
    parts: Sequence[Partitions],
    dp_group: dist.ProcessGroup | None,
    *,
    over_dp: bool,
) -> int:
    """Every rank's stacked states become the values of the ranks that computed each partition.

    Args:
        states: the stacked states (module docstring), updated in place.
        computed: per state, the partitions this rank computed this step.
        parts: per state, its param's partitions.
        over_dp: whether ranks of ``dp_group`` differ (owner mode); else only TP groups do.

    Collective: an all_reduce over ``dp_group`` (``over_dp``), then one per distinct TP group
    (``Partitions.group``), in first-appearance order. Returns the number of collectives run.
    """
    if not states:
        return 0
    values = []
    for state, blocks, part in zip(states, computed, parts, strict=True):
        value = torch.full_like(state, _NOT_COMPUTED)
        chunks, sources = value.chunk(part.count), state.chunk(part.count)
        for block in blocks:
            chunks[block].copy_(sources[block])
        values.append(value.flatten())
    flat = torch.cat(values)
    pieces = flat.split([v.numel() for v in values])
    collectives = 0
    if over_dp:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=dp_group)
        collectives += 1
    by_group: dict[tuple[int, ...], tuple[dist.ProcessGroup, list[int]]] = {}
    for i, part in enumerate(parts):
        if part.group is not None:
            key = tuple(group_ranks(part.group))
            by_group.setdefault(key, (part.group, []))[1].append(i)
    for group, indices in by_group.values():
        joined = torch.cat([pieces[i] for i in indices])
        dist.all_reduce(joined, op=dist.ReduceOp.MAX, group=group)
        collectives += 1
        sizes = [pieces[i].numel() for i in indices]
        for i, piece in zip(indices, joined.split(sizes), strict=True):
            pieces[i].copy_(piece)
    for state, piece in zip(states, pieces, strict=True):
        state.copy_(piece.view_as(state))
    return collectives

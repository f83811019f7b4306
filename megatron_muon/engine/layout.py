"""Row layout of a data-parallel-sharded parameter: which rows of the full matrix each rank holds.

Megatron-FSDP hands the optimizer each weight as a DTensor sharded by whole rows (``Shard(0)``) over
the data-parallel group: contiguous, uneven, sometimes empty (``(0, cols)`` locally), replicated
across the outer mesh dim under HSDP with outer ``no_shard`` (``[Replicate(), Shard(0)]``), and a
plain full tensor (or ``Replicate``) under ``no_shard``. With tensor parallelism (TP > 1) a
TP-partitioned weight gets one more mesh axis: mesh ``(dp_cp, tp)`` (``(outer, inner, tp)`` under
HSDP), placements ``(Shard(0), Shard(partition_dim))``, and the global shape of the *unsplit*
weight; the TP split applies first, then the rows of each TP rank's partition are sharded over the
data-parallel ranks of that TP rank. ``DTensor.full_tensor()`` assumes ``torch.chunk`` splits in
mesh order and is wrong on these, so the layout is derived here from the DTensor's mesh,
placements and local shape (and Megatron-FSDP's ``megatron_fsdp_slice``), and gathered once, for
all params together, in a single ``all_gather`` of a small integer tensor over the data-parallel
group; it never changes between steps and is kept on the optimizer.

Vocabulary: the *matrix* of a param is its tensor-parallel-local, data-parallel-full tensor: shape
``(num_rows, *row_shape)`` (``row_shape`` is ``(cols,)`` for 2-D weights, ``(out, in)`` for 3-D
expert tensors whose rows are whole experts). A mesh *axis* is data-parallel when every rank along
it (through this rank) belongs to the data-parallel group, tensor-parallel when no rank along it
but this one does.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = [
    "all_gather_single",
    "check_same_params",
    "fsdp_row_offset",
    "gather_row_layouts",
    "group_ranks",
    "local_tensor",
    "matrix_shape",
    "mesh_axes",
    "ranks_along",
    "MeshAxes",
    "RowLayout",
    "TensorParallelSplit",
]

# ``all_gather_into_tensor`` was renamed ``all_gather_single`` (the old name warns) in torch 2.13.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

_UNKNOWN = -1


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (sharing storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` (None: the world; ``[0]`` without torch.distributed)."""
    if not dist.is_initialized():
        return [0]
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def new_member_group(ranks: list[int]) -> dist.ProcessGroup:
    """A process group of the global ``ranks``, this rank among them (collective over ``ranks``
    alone: ``use_local_synchronization``). torch >= 2.14 types ``new_group``'s result as a group or
    ``GroupMember.NON_GROUP_MEMBER``; a member always gets the group."""
    group = dist.new_group(ranks, use_local_synchronization=True)
    assert isinstance(group, dist.ProcessGroup), f"rank {dist.get_rank()} not in {ranks}"
    return group


@dataclass(frozen=True, slots=True)
class TensorParallelSplit:
    """A tensor-parallel mesh axis that splits a param: tensor dim ``dim`` over ``ranks``.

    Attributes:
        axis: the mesh axis.
        dim: the tensor dim split evenly over it (Megatron's ``partition_dim``).
        ranks: global ranks along the axis through this rank, in mesh order (the TP group).
    """

    axis: int
    dim: int
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class MeshAxes:
    """A param DTensor's mesh axes, told apart by the data-parallel group (axes of size 1 omitted).

    Attributes:
        data_parallel: data-parallel axes (placement ``Shard(0)`` or ``Replicate``).
        data_parallel_ranks: global ranks spanned by the data-parallel axes through this rank.
        tensor_parallel: tensor-parallel axes that split the param (``Shard(dim)``); a
            tensor-parallel axis with ``Replicate`` (a TP-duplicated param) splits nothing.
    """

    data_parallel: tuple[int, ...]
    data_parallel_ranks: tuple[int, ...]
    tensor_parallel: tuple[TensorParallelSplit, ...]


def ranks_along(param: DTensor, axes: Sequence[int]) -> tuple[int, ...]:
    """Global ranks of the sub-mesh spanned by ``axes`` through this rank's coordinate."""
    coordinate = param.device_mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"this rank is not in the device mesh of a param of shape {param.shape}")
    index = tuple(slice(None) if a in axes else c for a, c in enumerate(coordinate))
    return tuple(param.device_mesh.mesh[index].flatten().tolist())


def mesh_axes(param: DTensor, dp_ranks: Collection[int]) -> MeshAxes:
    """Which mesh axes of ``param`` are data-parallel and which split it by tensor parallelism.

    Args:
        param: a DTensor (any mesh: 1-D ``dp_cp``, HSDP ``(outer, inner)``, ``(dp_cp, tp)``, ...).
        dp_ranks: global ranks of the data-parallel group its rows are sharded over.

    Raises:
        ValueError: an axis neither inside nor across the data-parallel group, a placement other
            than ``Shard(0)``/``Replicate`` on a data-parallel axis or ``Shard``/``Replicate`` on
            a tensor-parallel one, or more than one tensor-parallel split.
    """
    dp_set = set(dp_ranks)
    me = dist.get_rank()
    data_parallel: list[int] = []
    splits: list[TensorParallelSplit] = []
    names = param.device_mesh.mesh_dim_names or ()
    for axis, placement in enumerate(param.placements):
        ranks = ranks_along(param, [axis])
        if len(ranks) == 1:
            continue
        label = f"mesh axis {axis}" + (f" ({names[axis]!r})" if axis < len(names) else "")
        where = f"param of shape {tuple(param.shape)}, placements {tuple(param.placements)}"
        if dp_set.issuperset(ranks):
            if not (
                type(placement) is Replicate or (type(placement) is Shard and placement.dim == 0)
            ):
                raise ValueError(
                    f"{label} over ranks {list(ranks)}, all in the data-parallel group "
                    f"{sorted(dp_set)}, has placement {placement}, but a data-parallel axis "
                    f"holds whole rows (Shard(0)) or replicas: is that group the one the model "
                    f"was wrapped with? ({where})"
                )
            data_parallel.append(axis)
        elif dp_set.intersection(ranks) == {me}:
            if type(placement) is Shard:
                splits.append(TensorParallelSplit(axis, placement.dim, ranks))
            elif type(placement) is not Replicate:
                raise ValueError(
                    f"{label} over tensor-parallel ranks {list(ranks)} has placement {placement}; "
                    f"expected Shard(partition_dim) or Replicate ({where})"
                )
        else:
            raise ValueError(
                f"{label} spans ranks {list(ranks)}, of which {sorted(dp_set.intersection(ranks))} "
                f"are in the data-parallel group {sorted(dp_set)}: it is neither a data-parallel "
                f"nor a tensor-parallel axis ({where})"
            )
    if len(splits) > 1:
        raise ValueError(
            f"a param of shape {tuple(param.shape)} is split over {len(splits)} tensor-parallel "
            f"mesh axes (placements {tuple(param.placements)}); one is supported"
        )
    return MeshAxes(tuple(data_parallel), ranks_along(param, data_parallel), tuple(splits))


def matrix_shape(param: torch.Tensor, axes: MeshAxes | None) -> tuple[int, ...]:
    """The param's tensor-parallel-local, data-parallel-full shape (its *matrix*).

    The global shape with each tensor-parallel split dim divided by its axis size (Megatron's TP
    splits are even). A plain tensor, or a DTensor without a TP axis, is its own matrix.
    """
    shape = list(param.shape)
    for split in axes.tensor_parallel if axes is not None else ():
        size = len(split.ranks)
        if shape[split.dim] % size:
            raise ValueError(
                f"a param of shape {tuple(param.shape)} is split over {size} tensor-parallel "
                f"ranks along dim {split.dim}, which does not divide evenly"
            )
        shape[split.dim] //= size
    return tuple(shape)


@dataclass(frozen=True, slots=True)
class RowLayout:
    """Which rows of a param's matrix each rank of the data-parallel group holds.

    Attributes:
        num_rows: rows of the matrix (tensor-parallel-local; padding rows trimmed).
        row_shape: shape of one row: ``(cols,)``, or ``(out, in)`` for a 3-D expert tensor.
        ranges: ``ranges[r] = (start, stop)``: rows held by group rank ``r`` (empty if none).
    """

    num_rows: int
    row_shape: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        covered = sorted({r for r in self.ranges if r[1] > r[0]})
        position = 0
        for start, stop in covered:
            # Intervals are either identical (replicas) or disjoint (shards) and tile [0, num_rows).
            if start != position:
                raise ValueError(
                    f"row shards do not tile the matrix: rows [{position}, {start}) are held by "
                    f"no rank, or shards overlap (ranges {self.ranges}, {self.num_rows} rows)"
                )
            position = stop
        if position != self.num_rows:
            raise ValueError(
                f"row shards cover {position} of {self.num_rows} rows (ranges {self.ranges})"
            )

    @property
    def row_numel(self) -> int:
        """Elements in one row."""
        numel = 1
        for size in self.row_shape:
            numel *= size
        return numel

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the full matrix: ``(num_rows, *row_shape)``."""
        return (self.num_rows, *self.row_shape)

    def rows_of(self, rank: int) -> int:
        """Number of rows group rank ``rank`` holds."""
        start, stop = self.ranges[rank]
        return stop - start

    def intervals(self) -> list[tuple[tuple[int, int], tuple[int, ...]]]:
        """Distinct non-empty row intervals with the group ranks holding each, by start row."""
        holders: dict[tuple[int, int], list[int]] = {}
        for rank, interval in enumerate(self.ranges):
            if interval[1] > interval[0]:
                holders.setdefault(interval, []).append(rank)
        return [(interval, tuple(holders[interval])) for interval in sorted(holders)]


def fsdp_row_offset(param: torch.Tensor) -> int | None:
    """First row of this rank's local shard in the param's matrix, from ``megatron_fsdp_slice``.

    Megatron-FSDP records on each optimizer param the slice of the flattened (tensor-parallel-local)
    param this rank holds; its start over the elements of one row is the shard's first row. It is
    the only reliable offset under HSDP outer sharding, where rank order is not row order, and
    under TP, where the TP split of dim 0 applies before the data-parallel one.

    Returns:
        The row offset, or None when the param carries no ``megatron_fsdp_slice``.

    Raises:
        ValueError: the slice does not cover whole rows of the local shard.
    """
    fsdp_slice = getattr(param, "megatron_fsdp_slice", None)
    if fsdp_slice is None:
        return None
    local = local_tensor(param)
    row_numel = max(1, local.shape[1:].numel())
    if fsdp_slice.stop - fsdp_slice.start != local.numel() or fsdp_slice.start % row_numel:
        raise ValueError(
            f"megatron_fsdp_slice {fsdp_slice} does not describe whole rows of the local "
            f"shard of shape {tuple(local.shape)}"
        )
    return fsdp_slice.start // row_numel


def _describe_local_rows(param: torch.Tensor, axes: MeshAxes | None) -> tuple[int, int, int, int]:
    """(row offset or UNKNOWN, local rows, shard-axis coordinate, replica key) of this rank."""
    local = local_tensor(param)
    num_local_rows = local.shape[0]
    if not isinstance(param, DTensor) or axes is None:
        return 0, num_local_rows, 0, 0
    shard_axes = [a for a in axes.data_parallel if isinstance(param.placements[a], Shard)]
    if not shard_axes:
        return 0, num_local_rows, 0, 0
    offset = fsdp_row_offset(param)
    if offset is not None:
        return offset, num_local_rows, 0, 0
    if len(shard_axes) > 1 or any(split.dim == 0 for split in axes.tensor_parallel):
        raise ValueError(
            f"a DTensor sharded on dim 0 over several mesh axes (placements "
            f"{tuple(param.placements)}) needs `megatron_fsdp_slice` to locate its rows"
        )
    coordinate = param.device_mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the param's device mesh"
    shard_axis = shard_axes[0]
    replica_key = 0
    for axis in axes.data_parallel:
        if axis != shard_axis:
            replica_key = replica_key * param.device_mesh.size(axis) + coordinate[axis]
    return _UNKNOWN, num_local_rows, coordinate[shard_axis], replica_key


def gather_row_layouts(
    params: Sequence[torch.Tensor], group: dist.ProcessGroup | None
) -> list[RowLayout]:
    """Row layout of every param's matrix over ``group``, in one ``all_gather``. Collective.

    Args:
        params: the optimizer's params (DTensor or plain), in the same order on every rank.
        group: the data-parallel group the rows are sharded over (``dp_cp`` or ``expt_dp``); with
            tensor parallelism, the data-parallel ranks of this rank's TP rank.

    Returns:
        One ``RowLayout`` per param, of its tensor-parallel-local matrix.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    dp_ranks = group_ranks(group)
    axes = [mesh_axes(p, dp_ranks) if isinstance(p, DTensor) else None for p in params]
    described = torch.tensor(
        [_describe_local_rows(p, a) for p, a in zip(params, axes, strict=True)], dtype=torch.int64
    ).reshape(len(params), 4)
    gathered = described
    if world > 1:
        gathered = torch.empty(world * len(params), 4, dtype=torch.int64)
        all_gather_single(gathered, described, group=group)
    table = gathered.view(world, len(params), 4).tolist()
    layouts = []
    for index, (param, param_axes) in enumerate(zip(params, axes, strict=True)):
        num_rows, *row_shape = matrix_shape(param, param_axes)
        local_row_shape = tuple(local_tensor(param).shape[1:])
        if tuple(row_shape) != local_row_shape:
            raise ValueError(
                f"param {index} of shape {tuple(param.shape)}: its local shard's rows have shape "
                f"{local_row_shape}, its tensor-parallel-local matrix's {tuple(row_shape)}"
            )
        rows = [table[r][index] for r in range(world)]
        offsets = _resolve_offsets(rows)
        ranges = tuple(
            (min(offset, num_rows), min(offset + row[1], num_rows))
            for offset, row in zip(offsets, rows, strict=True)
        )
        try:
            layouts.append(RowLayout(num_rows=num_rows, row_shape=local_row_shape, ranges=ranges))
        except ValueError as error:
            raise ValueError(f"param {index} of shape {tuple(param.shape)}: {error}") from None
    return layouts


def _resolve_offsets(rows: list[list[int]]) -> list[int]:
    """Fills UNKNOWN offsets: prefix sums of local rows along the shard axis, per replica family."""
    offsets = []
    for offset, _num_rows, coordinate, replica_key in rows:
        if offset != _UNKNOWN:
            offsets.append(offset)
            continue
        offsets.append(
            sum(
                other[1]
                for other in rows
                if other[3] == replica_key and other[2] < coordinate and other[0] == _UNKNOWN
            )
        )
    return offsets


def check_same_params(params: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Every rank of ``group`` holds the same number of params with the same global shapes.

    Collective over ``group`` (two small ``all_gather`` calls). Without it, ranks given different
    param lists would enter the layout gather with different sizes (gloo: "Received data size
    doesn't match") or pair different matrices up.

    Raises:
        ValueError: on every rank alike, naming the first param that differs.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return
    counts = torch.empty(world, dtype=torch.int64)
    all_gather_single(counts, torch.tensor([len(params)], dtype=torch.int64), group=group)
    if len(set(counts.tolist())) > 1:
        raise ValueError(
            f"ranks hold different numbers of params: {counts.tolist()} (ranks of the group in "
            "order); every rank must give the optimizer the same params in the same order"
        )
    # Global shapes, padded to 3 dims (Muon params are 2-D or 3-D).
    shapes = torch.tensor([list(p.shape) + [0] * (3 - p.ndim) for p in params], dtype=torch.int64)
    gathered = torch.empty(world * len(params), 3, dtype=torch.int64)
    all_gather_single(gathered, shapes.reshape(len(params), 3), group=group)
    table = gathered.view(world, len(params), 3)
    for index in range(len(params)):
        per_rank = [tuple(d for d in table[r, index].tolist() if d) for r in range(world)]
        if len(set(per_rank)) > 1:
            raise ValueError(
                f"param {index} has global shape {per_rank[0]} on the group's first rank but "
                f"{next(s for s in per_rank if s != per_rank[0])} on another: every rank must "
                "give the optimizer the same params in the same order"
            )

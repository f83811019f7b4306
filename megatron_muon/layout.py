"""Row layout of a data-parallel-sharded parameter: which rows of the full matrix each rank holds.

Megatron-FSDP hands the optimizer each weight as a DTensor sharded by whole rows (``Shard(0)``) over
the data-parallel group: contiguous, uneven, sometimes empty (``(0, cols)`` locally), replicated
across the outer mesh dim under HSDP with outer ``no_shard`` (``[Replicate(), Shard(0)]``), and a
plain full tensor (or ``Replicate``) under ``no_shard``. ``DTensor.full_tensor()`` assumes
``torch.chunk`` splits and is wrong on these (REFERENCE.md section 3), so the layout is derived here
from the local shapes and gathered once, for all params together, in a single ``all_gather`` of a
small integer tensor; it never changes between steps and is kept on the optimizer.

Vocabulary: the *matrix* of a param is its tensor-parallel-local, data-parallel-full tensor: shape
``(num_rows, *row_shape)`` (``row_shape`` is ``(cols,)`` for 2-D weights, ``(out, in)`` for 3-D
expert tensors whose rows are whole experts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = [
    "RowLayout",
    "all_gather_single",
    "check_same_params",
    "gather_row_layouts",
    "local_tensor",
]

# ``all_gather_into_tensor`` was renamed ``all_gather_single`` (the old name warns) in torch 2.13.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

_UNKNOWN = -1


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (sharing storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True, slots=True)
class RowLayout:
    """Which rows of a param's matrix each rank of the data-parallel group holds.

    Attributes:
        num_rows: rows of the matrix (the DTensor's global dim 0; padding rows trimmed).
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


def _describe_local_rows(param: torch.Tensor) -> tuple[int, int, int, int]:
    """(row offset or UNKNOWN, local rows, shard-dim coordinate, replica key) of this rank."""
    local = local_tensor(param)
    num_local_rows = local.shape[0]
    if not isinstance(param, DTensor):
        return 0, num_local_rows, 0, 0
    placements = param.placements
    shard_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    for i, placement in enumerate(placements):
        if not isinstance(placement, (Shard, Replicate)):
            raise ValueError(f"unsupported placement {placement} on mesh dim {i}")
    if not shard_dims:
        return 0, num_local_rows, 0, 0
    fsdp_slice = getattr(param, "megatron_fsdp_slice", None)
    row_numel = max(1, local.shape[1:].numel())
    if fsdp_slice is not None:
        # Megatron-FSDP records which slice of the flattened (TP-local) param this rank holds; the
        # only reliable offset under HSDP outer sharding, where rank order is not row order.
        if fsdp_slice.stop - fsdp_slice.start != local.numel() or fsdp_slice.start % row_numel:
            raise ValueError(
                f"megatron_fsdp_slice {fsdp_slice} does not describe whole rows of the local "
                f"shard of shape {tuple(local.shape)}"
            )
        return fsdp_slice.start // row_numel, num_local_rows, 0, 0
    if len(shard_dims) > 1:
        raise ValueError(
            f"a DTensor sharded on dim 0 over {len(shard_dims)} mesh dims needs "
            "`megatron_fsdp_slice` to locate its rows"
        )
    coordinate = param.device_mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the param's device mesh"
    shard_dim = shard_dims[0]
    replica_key = 0
    for i, size in enumerate(param.device_mesh.shape):
        if i != shard_dim:
            replica_key = replica_key * size + coordinate[i]
    return _UNKNOWN, num_local_rows, coordinate[shard_dim], replica_key


def gather_row_layouts(
    params: Sequence[torch.Tensor], group: dist.ProcessGroup | None
) -> list[RowLayout]:
    """Row layout of every param over ``group``, in one ``all_gather``. Collective over ``group``.

    Args:
        params: the optimizer's params (DTensor or plain), in the same order on every rank.
        group: the data-parallel group the rows are sharded over (``dp_cp`` or ``expt_dp``).

    Returns:
        One ``RowLayout`` per param.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    described = torch.tensor([_describe_local_rows(p) for p in params], dtype=torch.int64).reshape(
        len(params), 4
    )
    gathered = described
    if world > 1:
        gathered = torch.empty(world * len(params), 4, dtype=torch.int64)
        all_gather_single(gathered, described, group=group)
    table = gathered.view(world, len(params), 4).tolist()
    layouts = []
    for index, param in enumerate(params):
        rows = [table[r][index] for r in range(world)]
        offsets = _resolve_offsets(rows)
        num_rows = param.shape[0]
        row_shape = tuple(local_tensor(param).shape[1:])
        ranges = tuple(
            (min(offset, num_rows), min(offset + row[1], num_rows))
            for offset, row in zip(offsets, rows, strict=True)
        )
        try:
            layouts.append(RowLayout(num_rows=num_rows, row_shape=row_shape, ranges=ranges))
        except ValueError as error:
            raise ValueError(f"param {index} of shape {tuple(param.shape)}: {error}") from None
    return layouts


def _resolve_offsets(rows: list[list[int]]) -> list[int]:
    """Fills UNKNOWN offsets: prefix sums of local rows along the shard dim, per replica family."""
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

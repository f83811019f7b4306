"""The static plan of a Muon step: one record per 2-D matrix, built once by a pure function.

Everything about the optimizer's 2-D matrices that does not change between steps: what each is
(``NSMatrix``: its param, row layout over the data-parallel group, QKV split, whether its NS needs
tensor-parallel collectives) and what the plan decides for it (``MatrixPlan``: its NS cost and its
work blocks, i.e. which data-parallel ranks orthogonalize which rectangle of it), plus the exchange
buckets. ``plan_step`` computes it from shapes and the NS config alone, with no process group and
no tensor, so every rank (and every tensor-parallel rank of the same matrices) gets the identical
plan without communicating; ``ShardedMuon`` runs it, and the plan tool
(``python -m megatron_muon.plan``) calls the same function to predict a step's figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

from megatron_muon.engine.bucket_cuts import bucket_by_bytes, bucket_by_owner_rounds
from megatron_muon.engine.bucket_schedule import BucketJob, bucket_by_schedule, critical_path
from megatron_muon.engine.owner_locality import place_near_rows
from megatron_muon.engine.planner import MIN_SPLIT_FLOPS, OwnerPlan, plan_owners, plan_split_owners
from megatron_muon.engine.qkv import qkv_pieces
from megatron_muon.engine.tp_grid import row_parallel_split_blocks
from megatron_muon.newton_schulz.cost_model import (
    long_dim,
    pieces_flops,
    split_bounds,
    split_dim_of_pieces,
    split_pieces_flops,
)
from megatron_muon.newton_schulz.methods import NSConfig

if TYPE_CHECKING:
    from megatron_muon.engine.layout import RowLayout

__all__ = [
    "MatrixPlan",
    "NSMatrix",
    "StepPlan",
    "WorkBlock",
    "bucket_job",
    "exchanged_elements",
    "plan_step",
]

_EXCHANGE_BYTES = 4  # the exchange moves fp32 rows


@dataclass(frozen=True, slots=True)
class WorkBlock:
    """The rectangle of a 2-D matrix one rank orthogonalizes (or its whole matrix).

    A matrix with one owner has one block covering it; a matrix whose NS is split over ``g`` ranks
    has ``g`` blocks along its long dim (``split_newton_schulz``); under tp_mode layer_sharded a
    row-parallel matrix's blocks are rectangles of its stacked partitions
    (``tp_grid.row_parallel_split_blocks``).
    """

    rank: int  # group rank that receives this block and computes on it
    row_start: int
    row_stop: int
    col_start: int
    col_stop: int

    @staticmethod
    def whole(rank: int, layout: RowLayout) -> WorkBlock:
        """The whole matrix of ``layout``, on ``rank`` (columns: the first row dim)."""
        return WorkBlock(rank, 0, layout.num_rows, 0, layout.row_shape[0])


@dataclass(frozen=True, slots=True)
class NSMatrix:
    """A 2-D param as Newton-Schulz sees it.

    Attributes:
        param: position of the param in the optimizer's param order.
        layout: rows of its matrix (tensor-parallel-local, data-parallel-full; ``(rows, cols)``)
            held by each data-parallel rank.
        qkv_split_shapes: Q, K and V rows per query group when its NS runs on them apart
            (``qkv``); ``()`` otherwise.
        tp_collectives: its NS runs through ``TensorParallelMuon.orthogonalize``, whose
            tensor-parallel collectives need the whole matrix on one rank (never split).
        tp_partitions: under tp_mode ``layer_sharded``, the TP partitions stacked along the rows
            of ``layout`` (``tp_grid``); 1 otherwise.
        tp_partition_dim: the dim along which those partitions join into the unsplit matrix.
        own_orthogonalize: its orthogonalization is the optimizer's own per-matrix function on
            the whole matrix (an emerging optimizer other than Muon: ``orthogonalized``), never
            split.
    """

    param: int
    layout: RowLayout
    qkv_split_shapes: tuple[int, ...] = ()
    tp_collectives: bool = False
    tp_partitions: int = 1
    tp_partition_dim: int = 0
    own_orthogonalize: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of the matrix as it is exchanged (``layout``'s)."""
        return self.layout.num_rows, self.layout.row_shape[0]

    @property
    def ns_shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of the matrix NS runs on: the unsplit one of stacked TP partitions
        joined along ``tp_partition_dim`` (``tp_grid``), else ``shape``."""
        rows, cols = self.shape
        if self.tp_partition_dim == 1:
            return rows // self.tp_partitions, cols * self.tp_partitions
        return rows, cols

    @property
    def stock_ns(self) -> bool:
        """Its NS, where one rank runs it whole, is ``TensorParallelMuon``'s: with TP collectives
        (duplicated, distributed; never split) or on the unsplit matrix (layer_sharded); or the
        optimizer's own orthogonalization (``own_orthogonalize``, never split)."""
        return self.tp_collectives or self.tp_partitions > 1 or self.own_orthogonalize

    @property
    def row_parallel(self) -> bool:
        """Stacked TP partitions that join side by side (layer_sharded, ``partition_dim`` 1)."""
        return self.tp_partitions > 1 and self.tp_partition_dim == 1

    def split_pieces(self, max_split: int) -> tuple[tuple[int, int], ...] | None:
        """``pieces`` if its NS may be split over an aligned block of 2, 4, ... ``max_split``
        ranks, else None: never with TP collectives (they need the whole matrix on one rank) or
        the optimizer's own orthogonalization (it runs on the whole matrix); a row-parallel
        stacked matrix only where every such block is a rectangle of it
        (``tp_grid.row_parallel_split_blocks``: wide or square, not QKV)."""
        if self.tp_collectives or self.own_orthogonalize:
            return None
        if self.row_parallel:
            rows, cols = self.ns_shape
            if self.qkv_split_shapes or long_dim(rows, cols) != 1:
                return None
            per_partition = cols // self.tp_partitions
            sizes = (2**e for e in range(1, max_split.bit_length()))
            if any(
                row_parallel_split_blocks(rows, per_partition, self.tp_partitions, g) is None
                for g in sizes
            ):
                return None
        return self.pieces

    @property
    def pieces(self) -> tuple[tuple[int, int], ...]:
        """``(rows, cols)`` of each matrix NS runs on: Q, K and V under QKV split, else itself."""
        return qkv_pieces(*self.ns_shape, self.qkv_split_shapes)


@dataclass(frozen=True, slots=True)
class MatrixPlan:
    """One matrix and what the plan decides for it.

    Attributes:
        matrix: what the matrix is.
        cost: NS FLOPs of the whole matrix (summed over its pieces), the planner's load.
        work: the rectangle each computing rank orthogonalizes: one block (the owner's whole
            matrix), or one block per rank of an aligned block of ranks sharing its NS.
    """

    matrix: NSMatrix
    cost: int
    work: tuple[WorkBlock, ...]

    @property
    def split_size(self) -> int:
        """How many ranks share this matrix's NS (1: a single owner)."""
        return len(self.work)

    @property
    def ranks(self) -> tuple[int, int]:
        """``(first rank, number of ranks)`` of the ranks that orthogonalize this matrix."""
        return self.work[0].rank, len(self.work)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The static plan of one optimizer's 2-D matrices over one data-parallel group.

    Attributes:
        matrices: one record per 2-D matrix, in param order.
        owner_plan: the owners and each rank's NS load (``planner``).
        buckets: positions into ``matrices`` of the matrices exchanged together, each bucket in
            matrix order (``plan_step`` says how they are formed).
    """

    matrices: tuple[MatrixPlan, ...]
    owner_plan: OwnerPlan
    buckets: tuple[tuple[int, ...], ...]


def plan_step(
    matrices: Sequence[NSMatrix],
    group_size: int,
    ns_config: NSConfig,
    *,
    bucket_size_bytes: int | None = None,
    min_split_flops: int = MIN_SPLIT_FLOPS,
    max_split: int = 16,
    flops_per_byte: float = 0.0,
    element_bytes: int = 2,
    owner_buckets: bool = True,
) -> StepPlan:
    """The plan of ``matrices`` over a data-parallel group of ``group_size`` ranks. Pure.

    Each matrix's cost is its NS FLOPs under ``ns_config`` (the NS-method registry). Where the
    method is splittable (``NSConfig.splittable``), ``planner.plan_split_owners`` may split the NS
    of matrices costing at least ``min_split_flops`` (where ``NSMatrix.split_pieces`` allows)
    over up to ``max_split`` ranks, pricing split traffic at ``flops_per_byte``
    (``element_bytes`` per element); otherwise ``planner.plan_owners`` gives each matrix one
    owner (largest cost first onto the least-loaded rank).

    A one-owner plan then moves owners to ranks that hold more of their rows
    (``owner_locality.place_near_rows``; its largest load unchanged), unless a matrix's NS needs
    tensor-parallel collectives: those need the identical plan on every tensor-parallel rank,
    whose row layouts may differ.

    A rank waits at a bucket for the results of every matrix it holds rows of (the sequential
    bucket model, ``bucket_schedule``). In owner mode with more than one rank the buckets are
    ``bucket_schedule.bucket_by_schedule``'s cut (split plans too; ``bucket_by_owner_rounds``
    among its candidates), whose critical path the owner plan's ``critical_path`` is; otherwise
    (gather mode, one rank) consecutive matrices within the bound (``bucket_by_bytes``).

    Args:
        bucket_size_bytes: bound on the full fp32 bytes of the matrices one rank holds in one
            exchange bucket; ``None``: one bucket.
        owner_buckets: False for gather mode (``bucket_size_bytes`` then bounds a whole bucket).
    """
    costs = [pieces_flops(m.pieces, ns_config) for m in matrices]
    sizes = [_EXCHANGE_BYTES * m.shape[0] * m.shape[1] for m in matrices]
    if ns_config.splittable and max_split > 1:
        owner_plan = plan_split_owners(
            costs,
            group_size,
            [m.split_pieces(max_split) for m in matrices],
            ns_config.num_ns_steps,
            max_split=max_split,
            min_split_cost=min_split_flops,
            flops_per_byte=flops_per_byte,
            element_bytes=element_bytes,
        )
    else:
        owner_plan = plan_owners(costs, group_size)
    if group_size > 1 and not any(m.tp_collectives for m in matrices):
        traffic = [exchanged_elements(m.layout) for m in matrices]
        owner_plan = place_near_rows(owner_plan, costs, traffic)
    records = tuple(
        MatrixPlan(matrix, cost, _work_blocks(owner_plan, m, matrix))
        for m, (matrix, cost) in enumerate(zip(matrices, costs, strict=True))
    )
    jobs = [bucket_job(record, ns_config) for record in records]
    if owner_buckets and group_size > 1:
        owners = () if owner_plan.split_sizes else owner_plan.owners
        rounds = partial(bucket_by_owner_rounds, owners, costs, sizes) if owners else None
        buckets = bucket_by_schedule(jobs, group_size, bucket_size_bytes, rounds)
    else:
        buckets = bucket_by_bytes(sizes, bucket_size_bytes)
    if owner_buckets:
        owner_plan = replace(owner_plan, critical_path=critical_path(jobs, buckets, group_size))
    return StepPlan(records, owner_plan, tuple(tuple(b) for b in buckets))


def exchanged_elements(layout: RowLayout) -> list[int]:
    """Elements of ``layout``'s matrix that travel if group rank ``r`` orthogonalizes it whole,
    for each ``r``: the rows it lacks, to it (each interval from one holder), and every other
    holder's rows of the result, back (``OwnerExchange``). Rank ``r`` lacks every row outside its
    own interval (the intervals tile the matrix), so both terms fall by its rows."""
    held = [layout.rows_of(r) for r in range(len(layout.ranges))]
    total = layout.num_rows + sum(held)
    return [(total - 2 * rows) * layout.row_numel for rows in held]


def bucket_job(record: MatrixPlan, ns_config: NSConfig) -> BucketJob:
    """``record`` for the bucket model: each block's rank, NS FLOPs and fp32 bytes."""
    blocks = record.work
    work: tuple[tuple[int, int], ...]
    if len(blocks) == 1:
        work = ((blocks[0].rank, record.cost),)
    else:
        pieces = record.matrix.pieces
        steps = ns_config.num_ns_steps
        work = tuple(
            (block.rank, split_pieces_flops(pieces, steps, len(blocks), j))
            for j, block in enumerate(blocks)
        )
    held = tuple(
        _EXCHANGE_BYTES * (b.row_stop - b.row_start) * (b.col_stop - b.col_start) for b in blocks
    )
    layout = record.matrix.layout
    holders = tuple(r for r, (start, stop) in enumerate(layout.ranges) if stop > start)
    staged = tuple(_EXCHANGE_BYTES * layout.rows_of(r) * layout.row_numel for r in holders)
    return BucketJob(work, holders, held, staged)


def _work_blocks(plan: OwnerPlan, m: int, matrix: NSMatrix) -> tuple[WorkBlock, ...]:
    """Matrix ``m``'s work: the whole matrix on its owner, or blocks along its split dim."""
    size = plan.split_size(m)
    if size == 1:
        return (WorkBlock.whole(plan.owners[m], matrix.layout),)
    rows, cols = matrix.shape
    members = list(plan.members(m))
    if matrix.row_parallel:  # rectangles of the stacked partitions (tp_grid)
        unsplit_rows, unsplit_cols = matrix.ns_shape
        blocks = row_parallel_split_blocks(
            unsplit_rows, unsplit_cols // matrix.tp_partitions, matrix.tp_partitions, size
        )
        assert blocks is not None  # NSMatrix.split_pieces allowed the split
        return tuple(WorkBlock(rank, *block) for rank, block in zip(members, blocks, strict=True))
    if split_dim_of_pieces(matrix.pieces) == 0:
        return tuple(
            WorkBlock(rank, start, stop, 0, cols)
            for rank, (start, stop) in zip(members, split_bounds(rows, size), strict=True)
        )
    return tuple(
        WorkBlock(rank, 0, rows, start, stop)
        for rank, (start, stop) in zip(members, split_bounds(cols, size), strict=True)
    )

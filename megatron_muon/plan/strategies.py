"""Per-rank cost of one Muon step under each way of placing NS work, for one optimizer group.

A group is the Muon matrices of one optimizer instance (dense over the data-parallel group, or
experts over the expert-data-parallel group), each with its rows per rank (``fsdp_layout``). Every
strategy yields, per rank of the group: NS FLOPs executed, bytes sent and received, peak extra
memory, and collectives entered in one step.

- ``replicated`` (Megatron-LM PR #4486, ``FSDPTensorParallelMuon``): a matrix lying wholly on one
  rank is orthogonalized there; every other ("boundary") matrix is all-gathered (megatron_fsdp's
  uneven gather; counted unpadded) on every rank of the group, all before any NS, and
  orthogonalized on every rank. One ``all_gather_object`` per step agrees on the boundary set.
- ``round-robin``: owner of matrix ``i`` is rank ``i mod DP`` (the reference Muon's assignment),
  with the same owner exchange as ours.
- ``dion``: matrices grouped by shape, each group cut into batches of DP, the last padded with
  dummy matrices that are orthogonalized too; one all_to_all each way per batch moves even
  ``Shard(0)`` pieces (dion's own layout, in bf16 as dion sends them).
- ``ours``: ``planner.plan_split_owners`` (the owner plan, with the largest matrices' NS split over
  small rank blocks where one owner cannot balance); one batch of point-to-point messages each
  way per exchange bucket (``ShardedMuon``'s exchange) plus one small all_reduce of grad flags,
  plus the split NS collectives among each block (one ``split_scaled_orthogonalize`` call per
  piece, as ``ShardedMuon`` runs them).

Byte counts: the owner exchange moves fp32 rows (as ``ShardedMuon`` does); collectives count what
one rank puts on the wire for a ring algorithm (all_gather of ``n`` chunks: ``n - 1`` chunks out and
in; all_reduce of ``m`` bytes: ``2 m (n - 1) / n`` out and in). Peak extra memory: communication
buffers and full matrices held at once, plus the NS working set of the largest job (two copies of
``X``, ``A`` and ``B``) in the NS dtype; the optimizer state itself is not counted.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_muon.engine.bucket_cuts import bucket_by_bytes
from megatron_muon.engine.layout import RowLayout
from megatron_muon.engine.planner import MIN_SPLIT_FLOPS, OwnerPlan
from megatron_muon.engine.step_plan import NSMatrix, StepPlan, plan_step
from megatron_muon.newton_schulz.cost_model import (
    pieces_flops,
    split_bounds,
    split_dim_of_pieces,
    split_ns_bytes,
)
from megatron_muon.newton_schulz.methods import DEFAULT_NS_METHOD, NSConfig, NSMethodT
from megatron_muon.plan.models import Matrix

__all__ = ["STRATEGIES", "GroupCost", "GroupInput", "cost_of", "owner_exchange", "plan_for"]

STRATEGIES = ("replicated", "round-robin", "dion", "ours")
_EXCHANGE_BYTES = 4  # fp32 rows in the owner exchange and the all-gathers


@dataclass(frozen=True, slots=True)
class GroupInput:
    """One optimizer group: its matrices, their rows per rank, and the NS settings.

    Attributes:
        matrices: in param order.
        rows: ``rows[i][r]``: rows of matrix ``i`` on rank ``r`` of the group.
        group_size: ranks in the group.
        num_ns_steps: NS iterations.
        ns_bytes: bytes per element inside NS (2 under "medium" precision, 4 otherwise).
        max_split: largest rank block one matrix's NS may be split over (ours).
        flops_per_byte: ours: NS FLOPs one byte of split-NS traffic is worth to the planner.
        min_split_cost: ours: matrices under this many NS FLOPs are never split.
        ns_method: the NS method (``newton_schulz.NS_METHODS``): its FLOP count, and whether
            ours may split a matrix's NS.
        bucket_bytes: owner strategies exchange consecutive matrices whose full fp32 bytes fit
            this bound at once (``MuonFsdpConfig(bucket_size_bytes=...)``); ``None``: all at once.
    """

    matrices: Sequence[Matrix]
    rows: Sequence[np.ndarray]
    group_size: int
    num_ns_steps: int = 5
    ns_bytes: int = 2
    max_split: int = 16
    bucket_bytes: int | None = None
    flops_per_byte: float = 0.0
    min_split_cost: int = MIN_SPLIT_FLOPS
    ns_method: NSMethodT = DEFAULT_NS_METHOD

    @property
    def ns_config(self) -> NSConfig:
        """The NS settings ``ShardedMuon`` would run (costs through the NS-method registry)."""
        return _ns_config(self.num_ns_steps, self.ns_method)

    def buckets(self) -> list[list[int]]:
        """``ShardedMuon``'s exchange buckets (``bucket_cuts.bucket_by_bytes``): consecutive
        matrices within ``bucket_bytes`` fp32 bytes."""
        sizes = [_EXCHANGE_BYTES * m.shape[0] * m.shape[1] for m in self.matrices]
        return bucket_by_bytes(sizes, self.bucket_bytes)

    def cost(self, index: int) -> int:
        """NS FLOPs of matrix ``index``: the sum over its pieces (Q, K, V apart)."""
        return pieces_flops(self.matrices[index].pieces, self.ns_config)

    def workspace(self, pieces: Sequence[tuple[int, int]], parts: int = 1) -> int:
        """NS working set of the largest piece, split over ``parts`` ranks: 2 X + A + B."""
        largest = 0
        for rows, cols in pieces:
            k, long = min(rows, cols), max(rows, cols)
            largest = max(largest, (2 * k * -(-long // parts) + 2 * k * k) * self.ns_bytes)
        return largest


@dataclass(frozen=True, slots=True)
class GroupCost:
    """Per-rank figures of one step of one group under one strategy (arrays of ``group_size``).

    Attributes:
        useful_flops: NS FLOPs of the matrices themselves, once each (no replication, no padding).
        plan: the owner plan (owner strategies), else ``None``.
        split_bytes / split_collectives: the part of ``bytes_sent`` (and received) and of
            ``collectives`` that split NS adds inside rank blocks (zeros without splits).
    """

    strategy: str
    ns_flops: np.ndarray
    bytes_sent: np.ndarray
    bytes_received: np.ndarray
    peak_bytes: np.ndarray
    collectives: np.ndarray
    useful_flops: int
    plan: OwnerPlan | None = None
    split_bytes: np.ndarray | None = None
    split_collectives: np.ndarray | None = None


def cost_of(strategy: str, group: GroupInput) -> GroupCost:
    """The per-rank figures of ``strategy`` (one of ``STRATEGIES``) on ``group``."""
    if strategy == "replicated":
        return _replicated(group)
    if strategy == "round-robin":
        owners = tuple(i % group.group_size for i in range(len(group.matrices)))
        loads = [0] * group.group_size
        for i, owner in enumerate(owners):
            loads[owner] += group.cost(i)
        plan = OwnerPlan(owners, tuple(loads))
        return owner_exchange("round-robin", group, plan, group.buckets())
    if strategy == "dion":
        return _dion(group)
    if strategy == "ours":
        ours = plan_for(group)
        return owner_exchange("ours", group, ours.owner_plan, ours.buckets)
    raise ValueError(f"unknown strategy {strategy!r}; known: {STRATEGIES}")


def plan_for(group: GroupInput, tp_partitions: Sequence[tuple[int, int]] | None = None) -> StepPlan:
    """Our plan: ``step_plan.plan_step``, the function ``ShardedMuon`` plans with, on this
    group's matrices and rows. ``tp_partitions[i] = (count, dim)`` with ``count > 1``: matrix
    ``i`` is a TP-split weight exchanged over the grid (``--muon-tp-mode layer_sharded``), as
    ``NSMatrix.tp_partitions`` / ``tp_partition_dim`` say at run time: the whole weight
    (``dim`` 0) or its stacked partitions (``dim`` 1)."""
    matrices = []
    for i, (matrix, rows) in enumerate(zip(group.matrices, group.rows, strict=True)):
        stops = np.cumsum(rows)
        ranges = tuple(zip((stops - rows).tolist(), stops.tolist(), strict=True))
        layout = RowLayout(matrix.shape[0], (matrix.shape[1],), ranges)
        parts, dim = tp_partitions[i] if tp_partitions is not None else (1, 0)
        matrices.append(
            NSMatrix(
                i,
                layout,
                qkv_split_shapes=_split_shapes(matrix),
                tp_partitions=parts,
                tp_partition_dim=dim,
            )
        )
    return plan_step(
        matrices,
        group.group_size,
        group.ns_config,
        bucket_size_bytes=group.bucket_bytes,
        min_split_flops=group.min_split_cost,
        max_split=group.max_split,
        flops_per_byte=group.flops_per_byte,
        element_bytes=group.ns_bytes,
    )


def _split_shapes(matrix: Matrix) -> tuple[int, ...]:
    """QKV split shapes giving ``matrix.pieces`` (``NSMatrix.pieces``): the planner needs only
    the pieces' shapes, so the rows of Q, K and V themselves serve, in one query group."""
    return tuple(rows for rows, _ in matrix.pieces) if len(matrix.pieces) > 1 else ()


@functools.cache
def _ns_config(num_ns_steps: int, ns_method: NSMethodT) -> NSConfig:
    return NSConfig(num_ns_steps=num_ns_steps, ns_method=ns_method)


def _zeros(group: GroupInput) -> np.ndarray:
    return np.zeros(group.group_size, dtype=np.int64)


def _replicated(group: GroupInput) -> GroupCost:
    flops, sent, held, workspace = _zeros(group), _zeros(group), _zeros(group), _zeros(group)
    boundary = 0
    for i, matrix in enumerate(group.matrices):
        rows = group.rows[i]
        holders = np.flatnonzero(rows)
        cost = group.cost(i)
        need = group.workspace(matrix.pieces)
        if len(holders) <= 1:  # wholly local: NS by its holder, no communication
            flops[holders] += cost
            workspace[holders] = np.maximum(workspace[holders], need)
            continue
        boundary += 1
        flops += cost
        full = matrix.shape[0] * matrix.shape[1] * _EXCHANGE_BYTES
        sent += full - rows * matrix.shape[1] * _EXCHANGE_BYTES  # uneven all_gather, unpadded
        held += full  # all boundary matrices are gathered before any NS runs
        workspace = np.maximum(workspace, need)
    collectives = _zeros(group) + 1 + boundary
    useful = sum(group.cost(i) for i in range(len(group.matrices)))
    peak = held + workspace
    return GroupCost("replicated", flops, sent, sent.copy(), peak, collectives, useful)


def _dion(group: GroupInput) -> GroupCost:
    size = group.group_size
    flops, sent, peak = _zeros(group), _zeros(group), _zeros(group)
    batches = 0
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, matrix in enumerate(group.matrices):
        by_shape.setdefault(matrix.shape, []).append(i)
    for (rows, cols), members in by_shape.items():
        count = -(-len(members) // size)  # batches, the last padded to the group size
        batches += count
        cost = group.cost(members[0])
        flops += count * cost  # every rank orthogonalizes one (real or dummy) matrix per batch
        piece = -(-rows // size) * cols * 2  # bf16 Shard(0) piece
        sent += count * 2 * (size - 1) * piece  # all_to_all there and back
        workspace = group.workspace(group.matrices[members[0]].pieces)
        peak = np.maximum(peak, 2 * size * piece + workspace)
    useful = sum(group.cost(i) for i in range(len(group.matrices)))
    collectives = _zeros(group) + 2 * batches
    return GroupCost("dion", flops, sent, sent.copy(), peak, collectives, useful)


def owner_exchange(
    strategy: str, group: GroupInput, plan: OwnerPlan, buckets: Sequence[Sequence[int]]
) -> GroupCost:
    """Figures of an owner plan (split matrices included) under ``ShardedMuon``'s exchange of
    ``buckets``."""
    flops = np.asarray(plan.loads, dtype=np.int64)
    sent, peak, workspace = _zeros(group), _zeros(group), _zeros(group)
    split_bytes, split_collectives = _zeros(group), _zeros(group)
    for bucket in buckets:
        staged, held = _zeros(group), _zeros(group)
        for i in bucket:
            out, keep, extra = _matrix_exchange(group, plan, i, workspace)
            sent += out
            staged += keep
            held += extra
            members = plan.members(i)
            if len(members) > 1:
                # ShardedMuon runs one split_scaled_orthogonalize per piece: a norm all_reduce,
                # then an all_reduce and an all_gather per NS step, among the block's ranks.
                pieces = group.matrices[i].pieces
                wire = split_ns_bytes(pieces, group.num_ns_steps, len(members), group.ns_bytes)
                split_bytes[members.start : members.stop] += wire
                split_collectives[members.start : members.stop] += len(pieces) * (
                    1 + 2 * group.num_ns_steps
                )
        peak = np.maximum(peak, staged + held)
    sent += split_bytes
    # grad-flag all_reduce, then per bucket one batch of messages there and one back
    collectives = _zeros(group) + 1 + 2 * len(buckets) + split_collectives
    useful = sum(group.cost(i) for i in range(len(group.matrices)))
    return GroupCost(
        strategy,
        flops,
        sent,
        sent.copy(),
        peak + workspace,
        collectives,
        useful,
        plan,
        split_bytes,
        split_collectives,
    )


def _matrix_exchange(
    group: GroupInput,
    plan: OwnerPlan,
    i: int,
    workspace: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes each rank sends for matrix ``i`` (there and back), stages, and holds full.

    Updates ``workspace`` (the NS working set) in place.
    """
    matrix = group.matrices[i]
    rows, cols = matrix.shape
    own = group.rows[i] * cols * _EXCHANGE_BYTES
    staged = own.copy()
    held = _zeros(group)
    members = plan.members(i)
    parts = len(members)
    out = own.copy()
    if parts == 1:
        owner = members[0]
        out[owner] = rows * cols * _EXCHANGE_BYTES - own[owner]
        staged[owner] = 0
        held[owner] = rows * cols * _EXCHANGE_BYTES
        workspace[owner] = max(workspace[owner], group.workspace(matrix.pieces))
        return out, staged, held
    # Split: member j receives block j along the split dim from every holder, and sends it back.
    dim = split_dim_of_pieces(matrix.pieces)
    assert dim is not None
    bounds = split_bounds(matrix.shape[dim], parts)
    offsets = np.concatenate([[0], np.cumsum(group.rows[i])[:-1]])
    for j, rank in enumerate(members):
        lo, hi = bounds[j]
        if dim == 1:
            kept = group.rows[i][rank] * (hi - lo)  # its own rows of its column block
            incoming = (rows - group.rows[i][rank]) * (hi - lo)
        else:
            start = offsets[rank]
            kept = max(0, min(hi, start + group.rows[i][rank]) - max(lo, start)) * cols
            incoming = (hi - lo) * cols - kept
        out[rank] = own[rank] + (incoming - kept) * _EXCHANGE_BYTES
        held[rank] = (hi - lo) * (cols if dim == 0 else rows) * _EXCHANGE_BYTES
        workspace[rank] = max(workspace[rank], group.workspace(matrix.pieces, parts))
    return out, staged, held

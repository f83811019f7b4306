"""Our owner step under each ``--muon-tp-mode``: NS FLOPs, bytes and critical path per GPU.

With tensor parallelism each TP-split weight is ``tp`` partitions (``Matrix.tp_dim``), each
sharded by rows over its TP rank's data-parallel group. The three modes differ in what NS runs on
and where:

- ``blockwise`` (Megatron's default): every TP rank orthogonalizes its own partition, planned over
  its DP group (``strategies``' "ours" on TP-local shapes). Cheap, but not Muon's update of the
  whole weight: its FLOPs are those of the blocks, below the full-matrix figure.
- ``duplicated``: the owner of each TP-split matrix (planned over DP from TP-local shapes, never
  split, as ``ShardedMuon`` plans matrices whose NS has TP collectives) all-gathers the whole
  matrix over TP, and every TP rank runs the same full NS: ``tp`` times the full-matrix work.
  Bytes: the DP owner exchange of the TP-local rows, plus the TP all-gather on the owners (ring:
  ``tp - 1`` partitions out and in, fp32); peak: plus the gathered matrix.
- ``layer_sharded``: the owner pool is the whole DP x TP grid (experts: expert DP x expert TP):
  each whole matrix is assembled once, on one grid rank, from every partition's row shards,
  orthogonalized once, and its rows sent back; above the split threshold its NS is split over an
  aligned block of grid ranks as the DP owner step splits (``NSMatrix.split_pieces``: a
  row-parallel weight where each block is a rectangle of its stacked partitions), as
  ``ShardedMuon`` runs it (``step_plan.plan_step`` over the grid; bytes: the whole matrix in and
  out). Column-parallel weights are planned on their whole shape, row-parallel ones on their
  stacked partitions ``(tp * rows, cols)`` (``tp_grid``), each grid rank holding its DP rank's
  rows of its partition. A weight every TP rank holds whole (router, MLA down-projections) is
  planned once over the grid too, its rows taken from TP rank 0's copy and the result sent to
  every copy. A TP-split weight's rows are laid out over the grid ranks in rank order (rows per
  rank exact; in the stacked matrix partition ``t``'s rows lie together instead), which moves
  only where the planner places owners near rows and which rows a split block keeps.

Critical path: ``bucket_schedule.critical_path`` of each optimizer group under its buckets (the
bound given), the dense group's then the experts' (two optimizer steps one after the other);
``over ideal`` divides by the full-matrix NS FLOPs spread evenly over the DP x TP ranks (expert
DP x expert TP), what exact Muon must do at the least.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal, get_args

import numpy as np

from megatron_muon.engine.bucket_schedule import BucketJob, critical_path
from megatron_muon.engine.layout import RowLayout
from megatron_muon.engine.step_plan import NSMatrix, bucket_job, plan_step
from megatron_muon.newton_schulz.cost_model import pieces_flops
from megatron_muon.plan.fsdp_layout import layout_rows
from megatron_muon.plan.model_specs import ModelSpec
from megatron_muon.plan.models import Matrix, Parallelism, muon_matrices
from megatron_muon.plan.strategies import GroupInput, cost_of, owner_exchange, plan_for

__all__ = [
    "TP_MODES",
    "PlanTpModeT",
    "TpModeFigures",
    "format_tp_modes",
    "grid_rows",
    "tp_mode_figures",
]

PlanTpModeT = Literal["blockwise", "duplicated", "layer_sharded"]
TP_MODES: tuple[PlanTpModeT, ...] = get_args(PlanTpModeT)
_FP32 = 4


@dataclass(frozen=True, slots=True)
class TpModeFigures:
    """Per-GPU figures of one step of ours under one TP mode (max / mean over GPUs).

    Attributes:
        ideal_flops: full-matrix NS FLOPs spread evenly over DP x TP (dense) plus over expert DP
            x expert TP (experts): the least any exact mode can put on a GPU.
        critical_path_over_ideal: the dense group's critical path plus the experts', over
            ``ideal_flops`` (blockwise can fall below 1: it runs NS on blocks).
    """

    mode: str
    ns_flops_max: int
    ns_flops_mean: float
    ideal_flops: float
    flops_max_over_ideal: float
    critical_path_over_ideal: float
    bytes_sent_max: int
    bytes_sent_mean: float
    peak_bytes_max: int
    num_split_matrices: int

    def to_dict(self) -> dict:
        """Plain-JSON form."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _GroupFigures:
    """One optimizer group's figures per grid rank (``dp x tp``, TP fastest)."""

    flops: np.ndarray
    sent: np.ndarray
    peak: np.ndarray
    critical_path: int
    ideal: float
    num_split: int


def tp_mode_figures(
    spec: ModelSpec,
    parallel: Parallelism,
    mode: PlanTpModeT,
    settings: GroupInput,
) -> TpModeFigures:
    """Ours under ``mode`` on ``spec`` at ``parallel``; ``settings`` gives the NS and planner
    settings and the bucket bound (its matrices, rows and group size are ignored)."""
    if mode not in TP_MODES:
        raise ValueError(f"unknown TP mode {mode!r}; known: {TP_MODES}")
    params = muon_matrices(spec, parallel)
    world = np.arange(parallel.world_size)
    per_gpu = []
    if params.dense:
        dense = _group(mode, params.dense, parallel.dp, parallel.tp, settings)
        per_gpu.append((dense, world))  # dense grid rank = global rank (TP fastest)
    if params.experts:
        etp = parallel.expert_tp
        experts = _group(mode, params.experts, parallel.expert_dp, etp, settings)
        per_gpu.append((experts, world // (etp * parallel.ep) * etp + world % etp))
    flops = sum(g.flops[index] for g, index in per_gpu)
    sent = sum(g.sent[index] for g, index in per_gpu)
    peak = sum(g.peak[index] for g, index in per_gpu)
    ideal = sum(g.ideal for g, _ in per_gpu)
    return TpModeFigures(
        mode=mode,
        ns_flops_max=int(np.max(flops)),
        ns_flops_mean=float(np.mean(flops)),
        ideal_flops=ideal,
        flops_max_over_ideal=float(np.max(flops)) / ideal if ideal else 1.0,
        critical_path_over_ideal=sum(g.critical_path for g, _ in per_gpu) / ideal if ideal else 1.0,
        bytes_sent_max=int(np.max(sent)),
        bytes_sent_mean=float(np.mean(sent)),
        peak_bytes_max=int(np.max(peak)),
        num_split_matrices=sum(g.num_split for g, _ in per_gpu),
    )


def _settings(settings: GroupInput, matrices: Sequence[Matrix], rows, size: int) -> GroupInput:
    return GroupInput(
        matrices, rows, size, settings.num_ns_steps, settings.ns_bytes, settings.max_split,
        settings.bucket_bytes, settings.flops_per_byte, settings.min_split_cost,
        settings.ns_method,
    )  # fmt: skip


def _group(
    mode: PlanTpModeT, local: Sequence[Matrix], dp: int, tp: int, settings: GroupInput
) -> _GroupFigures:
    rows = layout_rows(local, dp)
    full = [m.tp_full(tp) for m in local]
    probe = _settings(settings, full, rows, dp)
    ideal = sum(pieces_flops(m.pieces, probe.ns_config) for m in full) / (dp * tp)
    if mode == "layer_sharded":
        on_grid = [_on_grid(m, tp) for m in local]
        grid = _settings(settings, on_grid, grid_rows(local, rows, tp), dp * tp)
        parts = [(tp, m.tp_dim) if m.tp_dim is not None else (1, 0) for m in local]
        step_plan = plan_for(grid, parts)
        cost = owner_exchange("ours", grid, step_plan.owner_plan, step_plan.buckets)
        plan = cost.plan
        assert plan is not None and plan.critical_path is not None
        sent = cost.bytes_sent.copy()
        for i, matrix in enumerate(on_grid):
            if matrix.tp_dim is None and tp > 1:  # results to the other TP ranks' copies too
                members = plan.members(i)
                share = matrix.shape[0] * matrix.shape[1] * _FP32 // len(members)
                sent[members.start : members.stop] += (tp - 1) * share
        return _GroupFigures(
            cost.ns_flops, sent, cost.peak_bytes, plan.critical_path, ideal,
            len(plan.split_matrices()),
        )  # fmt: skip
    group = _settings(settings, local, rows, dp)
    if mode == "blockwise":
        cost = cost_of("ours", group)
        assert cost.plan is not None and cost.plan.critical_path is not None
        return _GroupFigures(  # a DP rank's figures on each of its TP ranks
            np.repeat(cost.ns_flops, tp), np.repeat(cost.bytes_sent, tp),
            np.repeat(cost.peak_bytes, tp), cost.plan.critical_path, ideal,
            len(cost.plan.split_matrices()),
        )  # fmt: skip
    return _duplicated(group, full, tp, ideal)


def _duplicated(group: GroupInput, full: Sequence[Matrix], tp: int, ideal: float) -> _GroupFigures:
    """ShardedMuon's duplicated mode: TP-split matrices one owner each (from TP-local shapes),
    full NS there on every TP rank, the TP all-gather added to the owner's bytes."""
    gathered = [tp > 1 and m.tp_dim is not None for m in group.matrices]
    matrices = [
        NSMatrix(i, _layout(m.shape, rows), _qkv(m), tp_collectives=g)
        for i, (m, rows, g) in enumerate(zip(group.matrices, group.rows, gathered, strict=True))
    ]
    plan = plan_step(
        matrices, group.group_size, group.ns_config, bucket_size_bytes=group.bucket_bytes,
        min_split_flops=group.min_split_cost, max_split=group.max_split,
        flops_per_byte=group.flops_per_byte, element_bytes=group.ns_bytes,
    )  # fmt: skip
    cost = owner_exchange("duplicated", group, plan.owner_plan, plan.buckets)
    flops, sent, peak = cost.ns_flops.copy(), cost.bytes_sent.copy(), cost.peak_bytes.copy()
    jobs = []
    for record, local, whole, g in zip(plan.matrices, group.matrices, full, gathered, strict=True):
        job = bucket_job(record, group.ns_config)
        if g:  # one owner (never split): the full NS on it
            owner = record.work[0].rank
            full_cost = pieces_flops(whole.pieces, group.ns_config)
            job = BucketJob(((owner, full_cost),), job.holders, job.held_bytes)
            flops[owner] += full_cost - record.cost
            local_bytes = local.shape[0] * local.shape[1] * _FP32
            sent[owner] += (tp - 1) * local_bytes
            peak[owner] = max(peak[owner], cost.peak_bytes[owner] + (tp - 1) * local_bytes)
        jobs.append(job)
    path = critical_path(jobs, plan.buckets, group.group_size)
    return _GroupFigures(
        np.repeat(flops, tp), np.repeat(sent, tp), np.repeat(peak, tp), path, ideal,
        len(plan.owner_plan.split_matrices()),
    )  # fmt: skip


def _on_grid(matrix: Matrix, tp: int) -> Matrix:
    """``matrix`` as ``layer_sharded`` exchanges it over the grid: the whole weight
    (column-parallel, or held whole by every TP rank), or a row-parallel weight's stacked
    partitions ``(tp * rows, cols)`` (``tp_grid``) with the whole weight's NS pieces."""
    if matrix.tp_dim != 1 or tp == 1:
        return matrix.tp_full(tp)
    rows, cols = matrix.shape
    return Matrix(matrix.name, (tp * rows, cols), matrix.tp_full(tp).pieces, matrix.unit)


def grid_rows(local: Sequence[Matrix], rows: Sequence[np.ndarray], tp: int) -> list[np.ndarray]:
    """Rows of each matrix as exchanged over the ``dp x tp`` grid (``_on_grid``) held by each
    grid rank (rank ``d * tp + t``).

    Args:
        local: TP-local matrices; ``rows[i][d]`` are the rows of ``local[i]`` DP rank ``d`` holds
            (the same on every TP rank).

    Returns:
        ``result[i][q]`` for grid rank ``q = d * tp + t``: ``rows[i][d]`` of a TP-split weight
        (its partition ``t``'s; a column-parallel weight's counted as the whole weight's rows,
        a row-parallel one's as its stacked partitions'); a weight every TP rank holds whole
        counts as held by TP rank 0's DP ranks (the copies on the other TP ranks only receive
        the result: ``tp_mode_figures`` adds those bytes to the owner's).
    """
    out = []
    for matrix, held in zip(local, rows, strict=True):
        held = np.asarray(held, dtype=np.int64)
        if tp == 1:
            out.append(held)
            continue
        if matrix.tp_dim is None:
            grid = np.zeros((len(held), tp), dtype=np.int64)
            grid[:, 0] = held
            out.append(grid.reshape(-1))
            continue
        out.append(np.repeat(held, tp))  # grid rank d * tp + t: its partition's rows of DP d
    return out


def _layout(shape: tuple[int, int], rows: np.ndarray) -> RowLayout:
    stops = np.cumsum(rows)
    ranges = tuple(zip((stops - rows).tolist(), stops.tolist(), strict=True))
    return RowLayout(shape[0], (shape[1],), ranges)


def _qkv(matrix: Matrix) -> tuple[int, ...]:
    return tuple(r for r, _ in matrix.pieces) if len(matrix.pieces) > 1 else ()


def format_tp_modes(figures: Sequence[TpModeFigures]) -> str:
    """The TP modes' figures as a text table (TFLOP, MiB per GPU per step)."""
    mib = 2**20
    lines = [
        "ours under each --muon-tp-mode (per GPU; ideal: full-matrix NS over DP x TP):",
        f"{'TP mode':<14} {'NS TFLOP max':>12} {'ideal':>9} {'max/ideal':>9} {'crit/ideal':>10} "
        f"{'sent MiB max':>13} {'mean':>9} {'peak MiB':>9} {'split':>5}",
    ]
    for f in figures:
        lines.append(
            f"{f.mode:<14} {f.ns_flops_max / 1e12:>12.2f} {f.ideal_flops / 1e12:>9.2f} "
            f"{f.flops_max_over_ideal:>9.3f} {f.critical_path_over_ideal:>10.3f} "
            f"{f.bytes_sent_max / mib:>13,.1f} {f.bytes_sent_mean / mib:>9,.1f} "
            f"{f.peak_bytes_max / mib:>9,.1f} {f.num_split_matrices:>5}"
        )
    lines.append(
        "blockwise orthogonalizes TP-local blocks (not the full matrix: below 1 is possible); "
        "duplicated runs the full NS on every TP rank; layer_sharded once over DP x TP."
    )
    return "\n".join(lines)

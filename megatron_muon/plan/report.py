"""One model at one parallel layout: every strategy's per-GPU figures, as a table or a dict.

Each GPU runs two Muon optimizer instances: dense matrices over its data-parallel group and experts
over its expert-data-parallel group. A GPU's figures are the sum of its rank's figures in both
(global rank ``g`` is dense DP rank ``g // tp`` and expert DP rank ``g // (expert_tp * ep)``,
Megatron's ``tp-cp-ep-dp`` rank order with CP = PP = 1).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from megatron_muon.newton_schulz.methods import DEFAULT_NS_METHOD, NSMethodT
from megatron_muon.plan.fsdp_layout import layout_rows
from megatron_muon.plan.model_specs import ModelSpec
from megatron_muon.plan.models import Parallelism, muon_matrices
from megatron_muon.plan.strategies import STRATEGIES, GroupCost, GroupInput, cost_of, plan_for

__all__ = ["PlanReport", "StrategyFigures", "analyze", "format_report"]


@dataclass(frozen=True, slots=True)
class StrategyFigures:
    """Per-GPU figures of one step under one strategy (max and mean over GPUs).

    ``flops_max_over_ideal`` divides by the useful NS FLOPs spread perfectly (dense work over DP,
    expert work over expert DP): replication and padding show there, not in ``max/mean``.
    ``critical_path_over_ideal`` (ours): the dense group's critical path under its exchange
    buckets plus the experts' (``bucket_schedule``: buckets one after another, a rank waiting for
    the results of the matrices it holds rows of), over the same ideal; ``None`` elsewhere.
    """

    strategy: str
    ns_flops_max: int
    ns_flops_mean: float
    flops_max_over_mean: float
    flops_max_over_ideal: float
    dense_max_over_ideal: float
    expert_max_over_ideal: float
    bytes_sent_max: int
    bytes_sent_mean: float
    bytes_received_max: int
    bytes_received_mean: float
    peak_bytes_max: int
    peak_bytes_mean: float
    collectives_max: int
    num_split_matrices: int
    critical_path_over_ideal: float | None = None


@dataclass(frozen=True, slots=True)
class PlanReport:
    """Everything ``python -m megatron_muon.plan`` prints for one model and layout."""

    model: str
    dp: int
    tp: int
    ep: int
    expert_dp: int
    expert_tp: int
    num_dense_matrices: int
    num_expert_matrices: int
    num_ns_steps: int
    ns_bytes: int
    bucket_bytes: int | None
    own_shard_bytes_max: int
    own_shard_bytes_mean: float
    planner_seconds: float
    strategies: tuple[StrategyFigures, ...]
    ns_method: str = DEFAULT_NS_METHOD

    def to_dict(self) -> dict:
        """Plain-JSON form."""
        return asdict(self)

    def figures(self, strategy: str) -> StrategyFigures:
        """The figures of ``strategy``."""
        for figures in self.strategies:
            if figures.strategy == strategy:
                return figures
        raise ValueError(f"no strategy {strategy!r} in this report")


def _ratio(costs: GroupCost | None) -> float:
    if costs is None or costs.useful_flops == 0:
        return 1.0
    ideal = costs.useful_flops / len(costs.ns_flops)
    return float(costs.ns_flops.max() / ideal)


def analyze(
    spec: ModelSpec,
    parallel: Parallelism,
    *,
    num_ns_steps: int = 5,
    ns_bytes: int = 2,
    max_split: int = 16,
    bucket_bytes: int | None = None,
    flops_per_byte: float = 0.0,
    ns_method: NSMethodT = DEFAULT_NS_METHOD,
    strategies: tuple[str, ...] = STRATEGIES,
) -> PlanReport:
    """Builds the Muon matrices, their FSDP layout, and every strategy's figures."""
    params = muon_matrices(spec, parallel)
    groups: dict[str, GroupInput] = {}
    if params.dense:
        groups["dense"] = GroupInput(
            params.dense, layout_rows(params.dense, parallel.dp), parallel.dp,
            num_ns_steps, ns_bytes, max_split, bucket_bytes, flops_per_byte,
            ns_method=ns_method,
        )  # fmt: skip
    if params.experts:
        size = parallel.expert_dp
        groups["experts"] = GroupInput(
            params.experts, layout_rows(params.experts, size), size,
            num_ns_steps, ns_bytes, max_split, bucket_bytes, flops_per_byte,
            ns_method=ns_method,
        )  # fmt: skip
    world = np.arange(parallel.world_size)
    index = {
        "dense": world // parallel.tp,
        "experts": world // (parallel.expert_tp * parallel.ep),
    }

    # CPU time: on a shared machine wall time measures the neighbours, not the planner.
    started = time.process_time()
    for group in groups.values():
        plan_for(group)
    planner_seconds = time.process_time() - started

    own = np.zeros(parallel.world_size, dtype=np.int64)
    for name, group in groups.items():
        held = sum(r * m.shape[1] * 4 for r, m in zip(group.rows, group.matrices, strict=True))
        own += np.asarray(held, dtype=np.int64)[index[name]]

    results = []
    for strategy in strategies:
        costs = {name: cost_of(strategy, group) for name, group in groups.items()}
        per_gpu = {
            field: sum(getattr(c, field)[index[name]] for name, c in costs.items())
            for field in ("ns_flops", "bytes_sent", "bytes_received", "peak_bytes", "collectives")
        }
        ideal = sum(c.useful_flops / len(c.ns_flops) for c in costs.values())
        flops = per_gpu["ns_flops"]
        paths = [c.plan.critical_path if c.plan is not None else None for c in costs.values()]
        critical = (
            sum(p for p in paths if p is not None) / ideal
            if ideal and paths and all(p is not None for p in paths)
            else None
        )
        results.append(
            StrategyFigures(
                strategy=strategy,
                ns_flops_max=int(flops.max()),
                ns_flops_mean=float(flops.mean()),
                flops_max_over_mean=float(flops.max() / flops.mean()) if flops.mean() else 1.0,
                flops_max_over_ideal=float(flops.max() / ideal) if ideal else 1.0,
                dense_max_over_ideal=_ratio(costs.get("dense")),
                expert_max_over_ideal=_ratio(costs.get("experts")),
                bytes_sent_max=int(per_gpu["bytes_sent"].max()),
                bytes_sent_mean=float(per_gpu["bytes_sent"].mean()),
                bytes_received_max=int(per_gpu["bytes_received"].max()),
                bytes_received_mean=float(per_gpu["bytes_received"].mean()),
                peak_bytes_max=int(per_gpu["peak_bytes"].max()),
                peak_bytes_mean=float(per_gpu["peak_bytes"].mean()),
                collectives_max=int(per_gpu["collectives"].max()),
                num_split_matrices=sum(
                    len(c.plan.split_matrices()) for c in costs.values() if c.plan is not None
                ),
                critical_path_over_ideal=critical,
            )
        )
    return PlanReport(
        model=spec.name,
        dp=parallel.dp,
        tp=parallel.tp,
        ep=parallel.ep,
        expert_dp=parallel.expert_dp,
        expert_tp=parallel.expert_tp,
        num_dense_matrices=len(params.dense),
        num_expert_matrices=len(params.experts),
        num_ns_steps=num_ns_steps,
        ns_bytes=ns_bytes,
        bucket_bytes=bucket_bytes,
        own_shard_bytes_max=int(own.max()),
        own_shard_bytes_mean=float(own.mean()),
        planner_seconds=planner_seconds,
        strategies=tuple(results),
        ns_method=ns_method,
    )


def _optional(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _mb(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def format_report(report: PlanReport) -> str:
    """The report as a text table (FLOPs in TFLOP, bytes in MiB, per GPU per step)."""
    experts = (
        f", {report.num_expert_matrices} expert over expert DP {report.expert_dp}"
        f" (EP {report.ep}, expert TP {report.expert_tp})"
        if report.num_expert_matrices
        else ""
    )
    lines = [
        f"{report.model}: DP {report.dp}, TP {report.tp}; Muon matrices per rank: "
        f"{report.num_dense_matrices} dense over DP{experts}",
        f"NS ({report.ns_method}) {report.num_ns_steps} steps, {report.ns_bytes}-byte NS dtype; "
        "exchange bucket "
        f"{'unbounded' if report.bucket_bytes is None else _mb(report.bucket_bytes) + ' MiB'}; "
        "own fp32 momentum "
        f"shard per GPU: max {_mb(report.own_shard_bytes_max)} MiB, "
        f"mean {_mb(report.own_shard_bytes_mean)} MiB",
        "",
        f"{'strategy':<12} {'NS TFLOP max':>12} {'mean':>9} {'max/mean':>8} {'max/ideal':>9} "
        f"{'crit/ideal':>10} "
        f"{'dense':>7} {'expert':>7} {'sent MiB max':>13} {'mean':>9} {'recv MiB max':>13} "
        f"{'mean':>9} {'peak MiB':>9} {'colls':>6} {'split':>5}",
    ]
    for f in report.strategies:
        lines.append(
            f"{f.strategy:<12} {f.ns_flops_max / 1e12:>12.2f} {f.ns_flops_mean / 1e12:>9.2f} "
            f"{f.flops_max_over_mean:>8.3f} {f.flops_max_over_ideal:>9.3f} "
            f"{_optional(f.critical_path_over_ideal):>10} {f.dense_max_over_ideal:>7.3f} "
            f"{f.expert_max_over_ideal:>7.3f} "
            f"{_mb(f.bytes_sent_max):>13} {_mb(f.bytes_sent_mean):>9} "
            f"{_mb(f.bytes_received_max):>13} {_mb(f.bytes_received_mean):>9} "
            f"{_mb(f.peak_bytes_max):>9} {f.collectives_max:>6} {f.num_split_matrices:>5}"
        )
    lines += [
        "",
        "max/ideal: largest per-GPU NS FLOPs over the useful NS FLOPs spread evenly; crit/ideal: "
        "the step's critical path under the exchange buckets (dense, then experts) over the same; "
        "dense / expert: max/ideal per optimizer group.",
        f"planner (ours, dense + experts): {report.planner_seconds * 1e3:.1f} ms CPU time",
    ]
    return "\n".join(lines)

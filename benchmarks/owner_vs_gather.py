"""Section 1: ``ShardedMuon`` owner vs gather at DP = 1, 2, 4 on Megatron-FSDP row shards of the
dense and MoE models: step time, per-rank NS FLOPs and bytes sent (max and mean over ranks), and
each mode's transient memory (read by ``benchmarks.memory``).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict

from benchmarks.config import BenchConfig
from benchmarks.launcher import run_ranks
from benchmarks.models import TransformerShapes
from benchmarks.optimizer_step import (
    MUON_KWARGS,
    peak_step_memory,
    sharded_params,
    time_alternating,
)
from benchmarks.section import RunContext, Section
from benchmarks.tables import gflop, table

__all__ = ["SECTION", "optimizer_step_section", "owner_vs_gather"]


def owner_vs_gather(
    rank: int,
    world_size: int,
    device: str,
    models: dict[str, TransformerShapes],
    warmup: int,
    repeats: int,
    bucket_size_bytes: int,
) -> dict:
    """ShardedMuon owner vs gather on Megatron-FSDP row shards of each model: time, stats, memory.

    All models are timed first, then their memory is measured (profiled steps). Memory is also
    measured for owner mode with ``bucket_size_bytes`` (``owner_bucketed``), the knob that bounds
    the full matrices held at once; it is not timed.

    Returns:
        ``{model name: {"seconds", "stats", "peak_step_bytes"}}`` for this rank.
    """
    from megatron_muon import ShardedMuon

    runs = {}
    for name, shapes in models.items():
        params = sharded_params(shapes, world_size, device)
        optimizers = {
            mode: ShardedMuon.from_keywords(params, mode=mode, **MUON_KWARGS)
            for mode in ("owner", "gather")
        }
        seconds = time_alternating(optimizers, device, warmup, repeats)
        stats = {mode: asdict(opt.step_stats) for mode, opt in optimizers.items()}
        bucketed = ShardedMuon.from_keywords(
            params, mode="owner", bucket_size_bytes=bucket_size_bytes, **MUON_KWARGS
        )
        for _ in range(warmup):  # as the timed ones were: one-time costs stay out of its figure
            bucketed.step()
        optimizers["owner_bucketed"] = bucketed
        runs[name] = {"seconds": seconds, "stats": stats, "optimizers": optimizers}
    results = {}
    for name, run in runs.items():
        optimizers = run.pop("optimizers")
        run["peak_step_bytes"] = peak_step_memory(optimizers, device)
        run["stats"]["owner_bucketed"] = asdict(optimizers["owner_bucketed"].step_stats)
        results[name] = run
    return results


def _max_mean(values: list[float]) -> tuple[float, float]:
    return max(values), statistics.fmean(values)


def _mode_summary(results: list[dict], mode: str) -> dict:
    """Per-rank StepStats of one mode reduced to max and mean across ranks."""
    summary: dict[str, float] = {}
    for field in ("ns_flops", "bytes_sent", "bytes_received", "peak_full_matrix_bytes"):
        high, mean = _max_mean([r["stats"][mode][field] for r in results])
        summary[f"{field}_max"], summary[f"{field}_mean"] = high, mean
    summary["num_collectives"] = results[0]["stats"][mode]["num_collectives"]
    summary["peak_step_bytes_max"] = max(r["peak_step_bytes"][mode] for r in results)
    return summary


def optimizer_step_section(config: BenchConfig, device: str, dp_sizes: list[int]) -> dict:
    """Section 1: owner vs gather at each DP size, dense and MoE (one launch per DP size)."""
    models = {"dense": config.dense, "moe": config.moe}
    by_model: dict[str, dict] = {name: {} for name in models}
    for dp in dp_sizes:
        per_rank = run_ranks(
            owner_vs_gather,
            dp,
            device,
            models,
            config.warmup,
            config.repeats,
            config.bucket_size_bytes,
        )
        for name in models:
            results = [r[name] for r in per_rank]
            # Every rank times the same barrier-to-barrier span; take the slowest rank's median.
            owner_s = max(r["seconds"]["owner"] for r in results)
            gather_s = max(r["seconds"]["gather"] for r in results)
            owner = _mode_summary(results, "owner")
            by_model[name][str(dp)] = {
                "owner_s": owner_s,
                "gather_s": gather_s,
                "gather_over_owner": gather_s / owner_s,
                "owner": owner,
                "gather": _mode_summary(results, "gather"),
                "owner_bucketed": _mode_summary(results, "owner_bucketed"),
                "bucket_size_bytes": config.bucket_size_bytes,
                "ns_flops_per_s_per_rank": owner["ns_flops_max"] / owner_s,
            }
    return {
        name: {
            "model": shapes.describe(),
            "num_matrices": len(shapes.shapes()),
            "num_params": shapes.num_params(),
            "by_dp": by_model[name],
        }
        for name, shapes in models.items()
    }


def report_lines(results: dict) -> list[str]:
    """Section 1 in the terminal table."""
    lines = ["1. Muon optimizer step, owner vs gather (median s; per-rank NS GFLOP, MiB sent)"]
    header = (
        f"{'model':>6} {'DP':>3} {'owner s':>9} {'gather s':>9} {'g/o':>6} "
        f"{'NS GF max/mean (owner)':>23} {'NS GF (gather)':>15} "
        f"{'sent MiB max/mean (owner)':>26} {'sent MiB (gather)':>18}"
    )
    lines.append(header)
    for name, model in results["optimizer_step"].items():
        for dp, e in model["by_dp"].items():
            o, g = e["owner"], e["gather"]
            lines.append(
                f"{name:>6} {dp:>3} {e['owner_s']:>9.3f} {e['gather_s']:>9.3f} "
                f"{e['gather_over_owner']:>5.2f}x "
                f"{gflop(o['ns_flops_max']) + ' / ' + gflop(o['ns_flops_mean']):>23} "
                f"{gflop(g['ns_flops_max']):>15} "
                f"{o['bytes_sent_max'] / 2**20:>12.1f} / {o['bytes_sent_mean'] / 2**20:<11.1f} "
                f"{g['bytes_sent_max'] / 2**20:>18.1f}"
            )
    for name, model in results["optimizer_step"].items():
        lines.append(f"   {name}: {model['model']} ({model['num_matrices']} Muon matrices)")
    lines.append("")
    return lines


def markdown_lines(results: dict) -> list[str]:
    """Section 1 as Markdown: one table row per model and DP size."""
    out = [
        "**1. Muon optimizer step, owner vs gather** (per-rank NS GFLOP and MiB sent: max / mean "
        "over ranks)",
        "",
    ]
    rows = []
    for name, model in results["optimizer_step"].items():
        for dp, e in model["by_dp"].items():
            o, g = e["owner"], e["gather"]
            rows.append(
                [
                    name,
                    dp,
                    f"{e['owner_s']:.3f}",
                    f"{e['gather_s']:.3f}",
                    f"**{e['gather_over_owner']:.2f}x**",
                    f"{gflop(o['ns_flops_max'])} / {gflop(o['ns_flops_mean'])}",
                    f"{gflop(g['ns_flops_max'])}",
                    f"{o['bytes_sent_max'] / 2**20:.1f} / {o['bytes_sent_mean'] / 2**20:.1f}",
                    f"{g['bytes_sent_max'] / 2**20:.1f}",
                ]
            )
    out += table(
        [
            "model",
            "DP",
            "owner s",
            "gather s",
            "gather/owner",
            "NS GFLOP owner",
            "NS GFLOP gather",
            "MiB sent owner",
            "MiB sent gather",
        ],
        rows,
    )
    for name, model in results["optimizer_step"].items():
        out.append(f"- {name}: {model['model']} ({model['num_matrices']} Muon matrices)")
    out.append("")
    return out


def _run(context: RunContext, results: dict) -> dict:
    return optimizer_step_section(context.config, context.device, context.dp_sizes)


SECTION = Section(
    key="optimizer_step",
    run=_run,
    figures=(
        *(
            f"optimizer_step.dense.by_dp.*.{figure}"
            for figure in (
                "owner_s",
                "gather_s",
                "gather_over_owner",
                "owner.ns_flops_max",
                "owner.ns_flops_mean",
                "owner.bytes_sent_max",
                "owner.bytes_sent_mean",
                "gather.ns_flops_max",
                "gather.bytes_sent_max",
                "ns_flops_per_s_per_rank",
            )
        ),
        *(
            f"optimizer_step.moe.by_dp.*.{figure}"
            for figure in (
                "owner_s",
                "gather_s",
                "gather_over_owner",
                "owner.ns_flops_max",
                "owner.bytes_sent_max",
                "owner.bytes_sent_mean",
            )
        ),
    ),
    report=report_lines,
    markdown=markdown_lines,
)

"""Section 5: the owner-mode step time as the hidden size doubles; the fitted growth exponent."""

from __future__ import annotations

from benchmarks.config import BenchConfig
from benchmarks.launcher import run_ranks
from benchmarks.measure import growth_exponent
from benchmarks.models import TransformerShapes
from benchmarks.optimizer_step import MUON_KWARGS, sharded_params, time_alternating
from benchmarks.section import RunContext, Section
from benchmarks.tables import gflop, table

__all__ = ["SECTION", "scaling_section", "size_scaling"]


def size_scaling(
    rank: int,
    world_size: int,
    device: str,
    shape_list: list[TransformerShapes],
    warmup: int,
    repeats: int,
) -> dict:
    """Owner-mode step seconds and NS FLOPs for each model size, on Megatron-FSDP row shards."""
    from megatron_muon import ShardedMuon

    rows = []
    for shapes in shape_list:
        params = sharded_params(shapes, world_size, device)
        optimizer = ShardedMuon.from_keywords(params, mode="owner", **MUON_KWARGS)
        seconds = time_alternating({"owner": optimizer}, device, warmup, repeats)["owner"]
        rows.append(
            {"hidden": shapes.hidden, "seconds": seconds, "ns_flops": optimizer.step_stats.ns_flops}
        )
        del optimizer, params
    return {"rows": rows}


def scaling_section(config: BenchConfig, device: str) -> dict:
    """Section 5: owner-mode step time as the hidden size doubles; fitted exponents."""
    dp = config.scaling_dp
    results = run_ranks(
        size_scaling, dp, device, list(config.scaling), config.warmup, config.repeats
    )
    hidden = [row["hidden"] for row in results[0]["rows"]]
    seconds = [max(r["rows"][i]["seconds"] for r in results) for i in range(len(hidden))]
    flops = [sum(r["rows"][i]["ns_flops"] for r in results) for i in range(len(hidden))]
    return {
        "dp": dp,
        "mode": "owner",
        "model": f"{config.scaling[0].num_layers} layer(s), MLP = 4 x hidden",
        "hidden": hidden,
        "seconds": seconds,
        "ns_flops_total": flops,
        "growth_exponent": growth_exponent(hidden, seconds),
        "growth_exponent_last_two": growth_exponent(hidden[-2:], seconds[-2:]),
        "ns_flops_exponent": growth_exponent(hidden, flops),
    }


def report_lines(results: dict) -> list[str]:
    """Section 5 in the terminal table."""
    sc = results["scaling"]
    lines = [f"5. Owner-mode step vs hidden size (DP={sc['dp']}, {sc['model']})"]
    for h, sec in zip(sc["hidden"], sc["seconds"], strict=True):
        lines.append(f"   hidden {h:>5}: {sec:.4f} s")
    lines.append(
        f"   growth exponent: {sc['growth_exponent']:.2f} over all sizes, "
        f"{sc['growth_exponent_last_two']:.2f} over the last two (NS FLOPs grow as "
        f"hidden^{sc['ns_flops_exponent']:.2f})"
    )
    return lines


def markdown_lines(results: dict) -> list[str]:
    """Section 5 as Markdown."""
    sc = results["scaling"]
    out = [f"**5. Owner-mode step vs hidden size** (DP={sc['dp']}, {sc['model']})", ""]
    out += table(
        ["hidden", "step s", "NS GFLOP (all ranks)"],
        [
            [h, f"{sec:.4f}", gflop(fl)]
            for h, sec, fl in zip(sc["hidden"], sc["seconds"], sc["ns_flops_total"], strict=True)
        ],
    )
    out.append(
        f"Growth exponent (time ~ hidden^k): k = {sc['growth_exponent']:.2f} over all sizes, "
        f"{sc['growth_exponent_last_two']:.2f} over the last two; NS FLOPs grow as "
        f"hidden^{sc['ns_flops_exponent']:.2f}."
    )
    out.append("")
    return out


def _run(context: RunContext, results: dict) -> dict:
    return scaling_section(context.config, context.device)


SECTION = Section(
    key="scaling",
    run=_run,
    figures=("scaling.hidden", "scaling.seconds", "scaling.growth_exponent"),
    report=report_lines,
    markdown=markdown_lines,
)

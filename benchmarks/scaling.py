"""Section 5: the owner-mode step time as the hidden size doubles; the fitted growth exponent."""

from __future__ import annotations

from benchmarks.config import BenchConfig
from benchmarks.launcher import run_ranks
from benchmarks.measure import growth_exponent
from benchmarks.models import TransformerShapes
from benchmarks.optimizer_step import MUON_KWARGS, sharded_params, time_alternating

__all__ = ["scaling_section", "size_scaling"]


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
        optimizer = ShardedMuon(params, mode="owner", **MUON_KWARGS)
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

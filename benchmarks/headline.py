"""The Muon step against its ideal: the four headline ratios, each from repeated measurements.

One repetition measures, in this order and with nothing else running in the benchmark:

1. the matmul rate of one rank alone in the dtype of the run's NS matmuls (``matmul_rate``: bf16
   under Megatron's default precision, fp32 where ``benchmarks.machine`` chose fp32 NS; one thread
   on CPU);
2. ``ShardedMuon`` in owner mode (its defaults, bucket size included) on Megatron-FSDP row shards
   of the dense model at DP=2 and at DP=1 (``owner_step``): median step time, NS FLOPs per rank,
   the transient memory of one step and the full matrices it held at once, and where one
   profiled step's time went (Newton-Schulz, collectives, copies, the rest);
3. ``ShardedMuon`` against megatron-core ``TensorParallelMuon`` (and emerging-optimizers ``Muon``)
   on the same full params at DP=1, stepped in turn (``stock_comparison.stock_comparison``).

From these, per repetition:

- ``step_over_ideal``: the DP=2 owner step over its ideal, the NS FLOPs of the busiest rank at the
  rate NS reaches on the same model's matrices alone (the DP=1 owner step's NS scope, one rank,
  profiled in step 2): what the step would take if it did nothing but its NS, at the speed NS runs
  at these shapes. The matmul rate of step 1 is the rate at one large square shape; on a CPU whose
  matrix unit (AMX) runs a 2048^3 bf16 matmul several times faster than NS at the bench's
  512-2048-wide shapes, an ideal at that rate would measure the kernel's efficiency at small shapes,
  not the cost of distributing NS; it is reported beside (``step_over_matmul_ideal``);
- ``ours_over_tensor_parallel_muon``: DP=1 ``ShardedMuon`` time over ``TensorParallelMuon``'s;
- ``transient_over_held``: the owner step's transient memory at DP=2 over the fp32 bytes of full
  matrices it held at once (``StepStats.peak_full_matrix_bytes``), the largest over ranks;
- ``dp1_over_dp2``: the DP=1 owner step time over the DP=2 one on the same model.

Each ratio is reported as the median of the repetitions with its range; the machine's load
average is read before and after. Two sections of ``python -m benchmarks``: ``SECTION`` (the
ratios) and ``MATMUL_PEAK`` (the repetitions' median matmul rate, shown against section 1's NS
rate); section 3 (``benchmarks.stock_comparison``) reads the repetitions too.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict

import torch.distributed as dist

from benchmarks.launcher import run_ranks
from benchmarks.measure import median, time_split, timed
from benchmarks.models import TransformerShapes
from benchmarks.optimizer_step import MUON_KWARGS, matmul_rate, peak_step_memory, sharded_params
from benchmarks.section import RunContext, Section
from benchmarks.stock_comparison import stock_comparison

__all__ = ["MATMUL_PEAK", "RATIOS", "SECTION", "headline_section", "owner_step"]

# name -> (what it is, target as (comparison, bound))
RATIOS = {
    "step_over_ideal": ("Muon optimizer step / ideal, DP=2", ("<=", 1.3)),
    "ours_over_tensor_parallel_muon": (
        "DP=1: ShardedMuon / megatron-core TensorParallelMuon",
        ("<=", 1.02),
    ),
    "transient_over_held": (
        "owner step transient memory / full matrices held at once, DP=2",
        ("<=", 2.0),
    ),
    "dp1_over_dp2": ("owner step DP=1 time / DP=2 time (speedup)", (">=", 1.8)),
}


def _profiler_scopes() -> dict[str, str]:
    """The optimizer's profiler scopes the time split reads: ``{part: scope name}``."""
    from megatron_muon.engine.exchange import COLLECTIVE_SCOPE
    from megatron_muon.engine.ns_runner import NS_SCOPE

    return {"newton_schulz": NS_SCOPE, "collectives": COLLECTIVE_SCOPE}


def owner_step(
    rank: int,
    world_size: int,
    device: str,
    shapes: TransformerShapes,
    warmup: int,
    repeats: int,
) -> dict:
    """One rank's owner-mode ``ShardedMuon`` step on Megatron-FSDP row shards of ``shapes``.

    Returns:
        ``seconds`` (median of ``repeats`` timed steps after ``warmup``), ``stats`` (the last
        step's ``StepStats``), ``transient_bytes`` (peak live tensor bytes above the step's start;
        GPU: ``max_memory_allocated``), ``split`` (one profiled step's seconds by part; CPU only).
    """
    from megatron_muon import ShardedMuon

    params = sharded_params(shapes, world_size, device)
    optimizer = ShardedMuon.from_keywords(params, mode="owner", **MUON_KWARGS)
    for _ in range(warmup):
        optimizer.step()
    seconds = median([timed(optimizer.step, device) for _ in range(repeats)])
    stats = asdict(optimizer.step_stats)
    split = None
    if device == "cpu":
        dist.barrier()
        split = time_split(optimizer.step, _profiler_scopes())
        dist.barrier()
    transient = peak_step_memory({"owner": optimizer}, device)["owner"]
    return {"seconds": seconds, "stats": stats, "transient_bytes": transient, "split": split}


def _repetition(shapes: TransformerShapes, device: str, warmup: int, repeats: int, size: int):
    """One repetition's measurements and ratios (module docstring)."""
    (rate,) = run_ranks(matmul_rate, 1, device, size, repeats)
    dp2 = run_ranks(owner_step, 2, device, shapes, warmup, repeats)
    (dp1,) = run_ranks(owner_step, 1, device, shapes, warmup, repeats)
    (stock,) = run_ranks(stock_comparison, 1, device, shapes, warmup, repeats)
    dp2_s = max(r["seconds"] for r in dp2)
    ns_flops = max(r["stats"]["ns_flops"] for r in dp2)
    # NS alone at the step's shapes: the DP=1 step's NS scope (CPU: profiled; GPU: no split, the
    # matmul rate stands in).
    ns_rate = (
        dp1["stats"]["ns_flops"] / dp1["split"]["newton_schulz"]
        if dp1["split"] is not None
        else rate["flops_per_s"]
    )
    ideal_s = ns_flops / ns_rate
    matmul_ideal_s = ns_flops / rate["flops_per_s"]
    stock_s = stock["seconds"]
    splits = [r["split"] for r in dp2 if r["split"] is not None]
    return {
        "matmul_flops_per_s": rate["flops_per_s"],
        "matmul_dtype": rate["dtype"],
        "dp2_step_s": dp2_s,
        "dp1_step_s": dp1["seconds"],
        "ns_flops_per_rank_max": ns_flops,
        "ns_alone_flops_per_s": ns_rate,
        "ideal_s": ideal_s,
        "matmul_ideal_s": matmul_ideal_s,
        "step_over_matmul_ideal": dp2_s / matmul_ideal_s,
        "transient_bytes": [r["transient_bytes"] for r in dp2],
        "held_bytes": [r["stats"]["peak_full_matrix_bytes"] for r in dp2],
        "bytes_sent_max": max(r["stats"]["bytes_sent"] for r in dp2),
        "dp1_transient_bytes": dp1["transient_bytes"],
        "dp1_held_bytes": dp1["stats"]["peak_full_matrix_bytes"],
        # Mean over ranks of each part of one profiled DP=2 step, and DP=1's.
        "dp2_split": {k: statistics.fmean(s[k] for s in splits) for k in splits[0]}
        if splits
        else None,
        "dp1_split": dp1["split"],
        "stock_s": stock_s,
        "ratios": {
            "step_over_ideal": dp2_s / ideal_s,
            "ours_over_tensor_parallel_muon": stock_s["ours"] / stock_s["tensor_parallel_muon"],
            "transient_over_held": max(
                r["transient_bytes"] / max(1, r["stats"]["peak_full_matrix_bytes"]) for r in dp2
            ),
            "dp1_over_dp2": dp1["seconds"] / dp2_s,
        },
    }


def _verdict(value: float, target: tuple[str, float]) -> bool:
    op, bound = target
    return value <= bound if op == "<=" else value >= bound


def headline_section(
    shapes: TransformerShapes,
    device: str,
    warmup: int,
    repeats: int,
    matmul_size: int,
    num_repetitions: int = 3,
) -> dict:
    """The headline ratios from ``num_repetitions`` repetitions (module docstring)."""
    load_before = os.getloadavg()
    repetitions = [
        _repetition(shapes, device, warmup, repeats, matmul_size) for _ in range(num_repetitions)
    ]
    load_after = os.getloadavg()
    ratios = {}
    for name, (label, target) in RATIOS.items():
        values = [r["ratios"][name] for r in repetitions]
        middle = statistics.median(values)
        ratios[name] = {
            "label": label,
            "target": list(target),
            "median": middle,
            "min": min(values),
            "max": max(values),
            "values": values,
            "holds": _verdict(middle, target),
        }
    return {
        "model": shapes.describe(),
        "num_repetitions": num_repetitions,
        "steps_per_figure": repeats,
        "matmul_size": matmul_size,
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "ratios": ratios,
        "repetitions": repetitions,
    }


def _range(values: list[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def format_headline(section: dict) -> list[str]:
    """The headline ratios side by side and the DP=2 step's time split, as Markdown lines."""
    n = section["num_repetitions"]
    before = ", ".join(f"{x:.2f}" for x in section["load_average_before"])
    after = ", ".join(f"{x:.2f}" for x in section["load_average_after"])
    lines = [
        f"**Headline ratios** ({section['model']}; each the median of {n} repetitions; every "
        f"time the median of {section['steps_per_figure']} steps; load average "
        f"before {before}, after {after})",
        "",
        "| ratio | target | median | range | each repetition | holds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for ratio in section["ratios"].values():
        op, bound = ratio["target"]
        values = ", ".join(f"{v:.3f}" for v in ratio["values"])
        lines.append(
            f"| {ratio['label']} | {op} {bound} | **{ratio['median']:.3f}** | "
            f"{_range(ratio['values'], 3)} | {values} | {'yes' if ratio['holds'] else 'no'} |"
        )
    reps = section["repetitions"]
    lines += ["", *_ideal_lines(section), ""]
    parts = ("newton_schulz", "collectives", "copies", "other", "total")
    rows = []
    for label, key in (("DP=2", "dp2_split"), ("DP=1", "dp1_split")):
        splits = [r[key] for r in reps if r[key] is not None]
        if splits:
            cells = [f"{statistics.median(s[p] for s in splits):.3f}" for p in parts]
            rows.append(f"| {label} | " + " | ".join(cells) + " |")
    if rows:
        lines += [
            "Where one profiled owner step's time goes (seconds, mean over ranks, median over "
            "repetitions; copies: copy operators outside Newton-Schulz and the collectives; "
            "collectives: time inside them, transfer and waiting for peers):",
            "",
            "| owner step | Newton-Schulz | collectives | copies | other | total |",
            "| --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    return lines


def _ideal_lines(section: dict) -> list[str]:
    """How the ideal DP=2 step was priced, and the ratio at the large-matmul rate beside it."""
    reps = section["repetitions"]
    rates = [r["matmul_flops_per_s"] / 1e12 for r in reps]
    ideal = [r["ideal_s"] for r in reps]
    dtype = reps[0].get("matmul_dtype", "bfloat16")
    flops = reps[0]["ns_flops_per_rank_max"] / 1e9
    if "ns_alone_flops_per_s" not in reps[0]:  # a run of before the NS-alone ideal
        return [
            f"Ideal DP=2 step: {flops:.1f} GFLOP of NS on the busiest rank at the {dtype} matmul "
            f"rate measured in each repetition ({section['matmul_size']}^3, one rank alone: "
            f"{_range(rates, 3)} TFLOP/s) = {_range(ideal, 3)} s."
        ]
    ns_rates = [r["ns_alone_flops_per_s"] / 1e12 for r in reps]
    at_matmul = [r["step_over_matmul_ideal"] for r in reps]
    return [
        f"Ideal DP=2 step: {flops:.1f} GFLOP of NS on the busiest rank at the rate NS reaches on "
        f"the model's matrices alone, measured in each repetition (the DP=1 owner step's NS, one "
        f"rank: {_range(ns_rates, 3)} TFLOP/s) = {_range(ideal, 3)} s. The {dtype} matmul rate "
        f"at {section['matmul_size']}^3, one rank alone, was {_range(rates, 3)} TFLOP/s; at that "
        f"rate the step / ideal ratio would be {_range(at_matmul, 3)}."
    ]


def ns_rate_report_lines(results: dict) -> list[str]:
    """The measured matmul rate and section 1's owner-mode NS rate, in the terminal table."""
    peak = results["matmul_peak"]
    return [
        "",
        f"NS rate: measured {peak['dtype']} matmul {peak['flops_per_s'] / 1e12:.3f} TFLOP/s "
        "per rank "
        f"({peak['size']}^3); owner-mode NS TFLOP/s per rank (dense, incl. communication): "
        + ", ".join(
            f"DP={dp} {e['ns_flops_per_s_per_rank'] / 1e12:.3f}"
            for dp, e in results["optimizer_step"]["dense"]["by_dp"].items()
        ),
    ]


def ns_rate_markdown_lines(results: dict) -> list[str]:
    """The same as Markdown, with each NS rate as a fraction of the matmul rate."""
    peak = results["matmul_peak"]
    dense = results["optimizer_step"]["dense"]["by_dp"]
    return [
        f"NS rate: measured {peak['dtype']} matmul {peak['flops_per_s'] / 1e12:.3f} TFLOP/s "
        "per rank "
        f"({peak['size']}^3); owner-mode NS TFLOP/s per rank, dense model, communication "
        "included: "
        + ", ".join(
            f"DP={dp} {e['ns_flops_per_s_per_rank'] / 1e12:.3f} "
            f"({e['ns_flops_per_s_per_rank'] / peak['flops_per_s']:.0%} of the matmul rate)"
            for dp, e in dense.items()
        )
        + ".",
        "",
    ]


def _run(context: RunContext, results: dict) -> dict:
    config = context.config
    return headline_section(
        config.dense, context.device, config.warmup, config.repeats, config.matmul_size
    )


def _lines(results: dict) -> list[str]:
    return [*format_headline(results["headline"]), ""]


SECTION = Section(
    key="headline",
    run=_run,
    figures=(
        *(f"headline.ratios.{name}.median" for name in RATIOS),
        *(f"headline.ratios.{name}.values" for name in RATIOS),
        "headline.load_average_before",
        "headline.load_average_after",
    ),
    report=_lines,
    markdown=_lines,
)


def matmul_peak(context: RunContext, results: dict) -> dict:
    """The run's matmul rate: the median of the headline repetitions' rates."""
    headline = results["headline"]
    rates = [r["matmul_flops_per_s"] for r in headline["repetitions"]]
    return {
        "dtype": headline["repetitions"][0].get("matmul_dtype", "bfloat16"),
        "size": headline["matmul_size"],
        "flops_per_s": statistics.median(rates),
        "measured": "median of the headline repetitions' rates",
    }


# Shown after section 5: the owner step's NS rate (section 1) as a fraction of this rate.
MATMUL_PEAK = Section(
    key="matmul_peak",
    run=matmul_peak,
    figures=("matmul_peak.flops_per_s",),
    report=ns_rate_report_lines,
    markdown=ns_rate_markdown_lines,
    derived=True,
)

"""``python -m benchmarks [--quick] [--out DIR] [--device cpu|cuda]``: our claims, measured.

Measures, in one run, each comparison side by side (optimizers alternate step by step in the same
processes; every time is the median of ``repeats`` steps after ``warmup`` steps, between barriers):

0. The headline ratios (``benchmarks.headline``), each from 3 repetitions: the owner step at DP=2
   over its ideal (NS FLOPs at the bf16 matmul rate), ours over ``TensorParallelMuon`` at DP=1,
   the owner step's transient memory over the full matrices it holds, and DP=1 over DP=2 time;
   where the owner step's time goes (profiler); the load average before and after.
1. Muon optimizer step, owner vs gather, at DP = 1, 2, 4 on Megatron-FSDP row shards of a small
   transformer's weights (dense and MoE): time, gather/owner, per-rank NS FLOPs and bytes sent.
2. Full training step (forward, backward, optimizer) of a Megatron-FSDP GPTModel, Muon vs AdamW.
3. Our Muon step vs megatron-core ``TensorParallelMuon`` and emerging-optimizers ``Muon`` (DP = 1;
   the median repetition of 0).
4. Peak memory of a training step, Muon vs AdamW; peak transient memory of owner vs gather steps.
5. Owner-mode step time as the hidden size doubles, and the fitted growth exponent.
6. Gram vs standard Newton-Schulz (``benchmarks.ns_methods``), and batched vs one-by-one NS per
   shape (``benchmarks.ns_batching``).
7. The exchange bucket size: owner step time and transient memory for each ``bucket_size_bytes``
   at DP=2 (``benchmarks.buckets``).

Writes ``DIR/results.json`` and ``DIR/results.md`` (default ``bench_out/``) and prints a table.
On CPU each rank runs one thread; DP = 4 on 2 cores oversubscribes, so read ratios measured in one
run, not absolute times.
On a GPU (``--device cuda``) the run is ``benchmarks.gpu_run``'s instead: sizes that mean something
on an 80 GB card (a 1B+ GPT at seq 4096, NS at hidden 4096-8192), one GPU, its own targets.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks import ns_batching, ns_methods
from benchmarks.buckets import bucket_section
from benchmarks.config import FULL, QUICK, BenchConfig
from benchmarks.headline import headline_section
from benchmarks.ideal_ratio import ideal_ratio_section, plot_ideal_ratio
from benchmarks.launcher import run_ranks
from benchmarks.machine import LIBRARY_NOTICE, choose_ns_precision, device_name, git_commit
from benchmarks.measure import growth_exponent
from benchmarks.optimizer_step import MUON_KWARGS, owner_vs_gather, size_scaling
from benchmarks.overlap import overlap_section
from benchmarks.peers import peers_section
from benchmarks.report import (
    ANCHOR,
    PEERS_FIGURES,
    format_markdown,
    format_report,
    missing_figures,
)
from benchmarks.training_step import muon_vs_adamw_step, training_step_memory

# The full run's stated time on 2 CPU cores, by the NS precision ``choose_ns_precision`` picks:
# bf16 NS about 11 minutes measured with nothing else running (Intel); fp32 NS, where bf16 is
# emulated, 35 minutes (2-core AMD EPYC, 2026-11-26).
STATED_MINUTES = {"medium": 15, "highest": 40}

# --------------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------------


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


def training_step_section(config: BenchConfig, device: str) -> tuple[dict, dict]:
    """Sections 2 and 4a: Muon vs AdamW whole step / optimizer step, and step peak memory."""
    size, dp = config.gpt, config.train_dp
    results = run_ranks(muon_vs_adamw_step, dp, device, size, config.warmup, config.repeats)
    muon = {k: max(r["muon"][k] for r in results) for k in ("step_s", "optimizer_s")}
    adamw = {k: max(r["adamw"][k] for r in results) for k in ("step_s", "optimizer_s")}
    timing = {
        "model": asdict(size),
        "dp": dp,
        "strategy": "optim_grads_params",
        "optimizers": {
            "muon": "megatron_muon.build_muon_optimizer: ShardedMuon (owner) for 2-D hidden "
            "weights + AdamW for the rest, grad clipping 1.0",
            "adamw": "megatron-core get_megatron_optimizer(optimizer='adam'): "
            "DistributedOptimizer, grad clipping 1.0",
        },
        "tokens_per_rank": size.tokens_per_rank(),
        "muon_step_s": muon["step_s"],
        "adamw_step_s": adamw["step_s"],
        "muon_over_adamw_step": muon["step_s"] / adamw["step_s"],
        "muon_optimizer_s": muon["optimizer_s"],
        "adamw_optimizer_s": adamw["optimizer_s"],
        "muon_over_adamw_optimizer": muon["optimizer_s"] / adamw["optimizer_s"],
        "muon_ns_flops_max": max(r["muon_ns_flops"] for r in results),
        "anchor": ANCHOR,
    }
    memory = {"dp": dp, "measure": "RSS" if device == "cpu" else "max_memory_allocated"}
    for kind in ("muon", "adamw"):
        per_rank = run_ranks(training_step_memory, dp, device, size, kind)
        # Training memory: the step's peak above the process's level before the model was built.
        memory[f"{kind}_peak_bytes"] = max(r["step_peak"] - r["before_model"] for r in per_rank)
        memory[f"{kind}_state_bytes"] = max(r["before_step"] - r["before_model"] for r in per_rank)
        memory[f"{kind}_peak_absolute_bytes"] = max(r["step_peak"] for r in per_rank)
    memory["muon_over_adamw"] = memory["muon_peak_bytes"] / memory["adamw_peak_bytes"]
    return timing, memory


def exchange_transient_section(optimizer_step: dict, device: str) -> dict:
    """Section 4b: a step's peak memory above its start, owner vs gather (from section 1's runs)."""
    by_model: dict[str, dict] = {}
    section = {
        "measure": "live tensor bytes (profiler allocation records)"
        if device == "cpu"
        else "max_memory_allocated",
        "by_model": by_model,
    }
    for name, model in optimizer_step.items():
        by_model[name] = {}
        for dp, entry in model["by_dp"].items():
            owner, gather = entry["owner"], entry["gather"]
            bucketed = entry["owner_bucketed"]
            by_model[name][dp] = {
                "owner_peak_step_bytes_max": owner["peak_step_bytes_max"],
                "gather_peak_step_bytes_max": gather["peak_step_bytes_max"],
                "owner_bucketed_peak_step_bytes_max": bucketed["peak_step_bytes_max"],
                "owner_full_matrix_bytes_max": owner["peak_full_matrix_bytes_max"],
                "gather_full_matrix_bytes_max": gather["peak_full_matrix_bytes_max"],
                "owner_bucketed_full_matrix_bytes_max": bucketed["peak_full_matrix_bytes_max"],
                "bucket_size_bytes": entry["bucket_size_bytes"],
                "gather_over_owner": gather["peak_step_bytes_max"]
                / max(1, owner["peak_step_bytes_max"]),
            }
    return section


def stock_section(config: BenchConfig, headline: dict) -> dict:
    """Section 3: ours vs TensorParallelMuon vs emerging-optimizers Muon on full params, DP = 1:
    the headline repetition whose ours/TensorParallelMuon ratio is the median."""
    reps = sorted(
        headline["repetitions"], key=lambda r: r["ratios"]["ours_over_tensor_parallel_muon"]
    )
    seconds = reps[len(reps) // 2]["stock_s"]
    return {
        "model": config.dense.describe(),
        "ours_s": seconds["ours"],
        "tensor_parallel_muon_s": seconds["tensor_parallel_muon"],
        "emerging_muon_s": seconds["emerging_muon"],
        "tensor_parallel_muon_over_ours": seconds["tensor_parallel_muon"] / seconds["ours"],
        "emerging_muon_over_ours": seconds["emerging_muon"] / seconds["ours"],
    }


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


def ns_methods_section(config: BenchConfig, out_dir: Path) -> list:
    """Section 6: Gram vs standard NS, by ``benchmarks.ns_methods`` (its table is printed too)."""
    path = out_dir / "ns_methods.json"
    status = ns_methods.main([*config.ns_methods_argv, "--json", str(path)])
    if status != 0:
        raise RuntimeError(f"benchmarks.ns_methods exited with status {status}")
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run (~30 s)")
    parser.add_argument("--out", default="bench_out", help="directory for results.json")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="also the peers, ideal-ratio and overlap sections (make bench runs them after "
        "installing the peers, make bench-peers-deps; about 7 minutes more on 2 CPU cores)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if args.device == "cuda":
        from benchmarks import gpu_run

        return gpu_run.main(args.out, quick=args.quick)
    config = QUICK if args.quick else FULL
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    max_ranks = torch.cuda.device_count() if args.device == "cuda" else max(config.dp_sizes)
    dp_sizes = [dp for dp in config.dp_sizes if dp <= max_ranks]
    skipped = [dp for dp in config.dp_sizes if dp > max_ranks]
    if config.train_dp > max_ranks or config.scaling_dp > max_ranks:
        config = _fit_ranks(config, max_ranks)

    results: dict = {}
    section_seconds: dict[str, float] = {}
    results["machine"] = choose_ns_precision(args.device)
    stated_minutes = STATED_MINUTES[results["machine"]["ns_precision"]]
    _print_machine(results["machine"], config)

    def timed_section(name: str, fn, *fn_args):
        start = time.monotonic()
        print(f"[bench] {name} ...", flush=True)
        value = fn(*fn_args)
        section_seconds[name] = time.monotonic() - start
        print(
            f"[bench] {name}: {section_seconds[name]:.0f} s "
            f"(run {time.monotonic() - started:.0f} s of ~{stated_minutes} min)",
            flush=True,
        )
        return value

    # A GPU needs a large product to reach its peak; one CPU thread reaches it at 2048.
    matmul_size = 8192 if args.device == "cuda" else config.matmul_size
    load_before = os.getloadavg()
    results["headline"] = timed_section(
        "headline",
        headline_section,
        config.dense,
        args.device,
        config.warmup,
        config.repeats,
        matmul_size,
    )
    if max_ranks >= 2:
        results["buckets"] = timed_section(
            "buckets",
            bucket_section,
            config.dense,
            args.device,
            config.bucket_sizes,
            config.warmup,
            config.repeats,
        )
    if args.peers:
        results["overlap"] = timed_section(
            "overlap",
            overlap_section,
            config.dense,
            args.device,
            dp_sizes,
            config.overlap_bucket_size_bytes,
            config.warmup,
            config.repeats,
        )
        results["peers"] = timed_section(
            "peers",
            peers_section,
            config.dense,
            config.gpt,
            args.device,
            dp_sizes,
            config.warmup,
            config.peer_repeats,
        )
    results["ns_methods"] = timed_section("ns_methods", ns_methods_section, config, out_dir)
    shapes = ns_batching.QUICK_SHAPES if args.quick else ns_batching.SHAPES
    results["ns_batching"] = timed_section("ns_batching", ns_batching.batching_rows, shapes)
    results["optimizer_step"] = timed_section(
        "optimizer_step", optimizer_step_section, config, args.device, dp_sizes
    )
    results["stock_comparison"] = stock_section(config, results["headline"])
    training, training_memory = timed_section(
        "training_step", training_step_section, config, args.device
    )
    results["training_step"] = training
    if args.peers:
        ideal = timed_section(
            "ideal_ratio",
            ideal_ratio_section,
            config.gpt,
            config.ideal_ratio_micro_batches,
            config.train_dp,
            args.device,
            config.warmup,
            config.repeats,
        )
        ideal["plot"] = plot_ideal_ratio(ideal, out_dir)
        results["ideal_ratio"] = ideal
    results["memory"] = {
        "training_step": training_memory,
        "exchange_transient": exchange_transient_section(results["optimizer_step"], args.device),
    }
    results["scaling"] = timed_section("scaling", scaling_section, config, args.device)
    rates = [r["matmul_flops_per_s"] for r in results["headline"]["repetitions"]]
    results["matmul_peak"] = {
        "dtype": results["headline"]["repetitions"][0].get("matmul_dtype", "bfloat16"),
        "size": matmul_size,
        "flops_per_s": statistics.median(rates),
        "measured": "median of the headline repetitions' rates",
    }
    results["meta"] = {
        "device": args.device,
        "device_name": device_name(args.device),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": args.quick,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "git_commit": git_commit(),
        "muon_kwargs": MUON_KWARGS,
        "warmup": config.warmup,
        "repeats": config.repeats,
        "peer_repeats": config.peer_repeats,
        "dp_sizes": dp_sizes,
        "dp_sizes_skipped_for_lack_of_devices": skipped,
        "seconds": time.monotonic() - started,
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "section_seconds": section_seconds,
        "results_path": str(out_dir / "results.json"),
    }
    missing = missing_figures(results, PEERS_FIGURES if args.peers else ())
    if missing:
        raise RuntimeError(f"results lack figures: {missing}")
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    (out_dir / "results.md").write_text(format_markdown(results) + "\n")
    print()
    print(format_report(results))
    return 0


def _print_machine(machine: dict, config: BenchConfig) -> None:
    """The run's first lines: rates, NS precision and why, sizes, and the notice said once."""
    rates = machine["rates"]
    if rates:
        print(
            f"[bench] matmul rates (one thread, 512^3): fp32 {rates['fp32'] / 1e9:.1f}, "
            f"bf16 {rates['bf16'] / 1e9:.1f} GFLOP/s",
            flush=True,
        )
    print(f"[bench] NS precision {machine['ns_precision']}: {machine['reason']}", flush=True)
    print(
        f"[bench] sizes: dense {config.dense.describe()}; MoE {config.moe.describe()}; DP "
        f"{list(config.dp_sizes)}; median of {config.repeats} steps after {config.warmup}",
        flush=True,
    )
    print(f"[bench] {LIBRARY_NOTICE}", flush=True)


def _fit_ranks(config: BenchConfig, max_ranks: int) -> BenchConfig:
    """The same config with the training and scaling runs on at most ``max_ranks`` ranks."""
    from dataclasses import replace

    return replace(
        config,
        train_dp=min(config.train_dp, max_ranks),
        scaling_dp=min(config.scaling_dp, max_ranks),
    )


if __name__ == "__main__":
    raise SystemExit(main())

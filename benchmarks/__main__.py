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
from pathlib import Path

import torch

from benchmarks import ns_batching
from benchmarks.buckets import bucket_section
from benchmarks.config import FULL, QUICK, BenchConfig
from benchmarks.headline import headline_section
from benchmarks.ideal_ratio import ideal_ratio_section, plot_ideal_ratio
from benchmarks.machine import LIBRARY_NOTICE, choose_ns_precision, device_name, git_commit
from benchmarks.memory import exchange_transient_section
from benchmarks.ns_methods import ns_methods_section
from benchmarks.optimizer_step import MUON_KWARGS
from benchmarks.overlap import overlap_section
from benchmarks.owner_vs_gather import optimizer_step_section
from benchmarks.peers import peers_section
from benchmarks.report import (
    PEERS_FIGURES,
    format_markdown,
    format_report,
    missing_figures,
)
from benchmarks.scaling import scaling_section
from benchmarks.stock_comparison import stock_section
from benchmarks.training_step import training_step_section

# The full run's stated time on 2 CPU cores, by the NS precision ``choose_ns_precision`` picks:
# bf16 NS about 11 minutes measured with nothing else running (Intel); fp32 NS, where bf16 is
# emulated, 35 minutes (2-core AMD EPYC, 2026-11-26).
STATED_MINUTES = {"medium": 15, "highest": 40}

# --------------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------------


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

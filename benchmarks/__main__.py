"""``python -m benchmarks [--quick] [--peers] [--out DIR] [--device cpu|cuda]``: our claims.

Runs the sections of ``SECTIONS`` in order, each one module (``benchmarks.section``: its
measurement, the figures it must produce, its lines in the report). Comparisons are side by side:
the optimizers compared alternate step by step in the same processes; every time is the median of
``repeats`` steps after ``warmup`` steps, between barriers.

- The headline ratios (``benchmarks.headline``), each from 3 repetitions: the owner step at DP=2
  over its ideal (NS FLOPs at the matmul rate), ours over ``TensorParallelMuon`` at DP=1, the owner
  step's transient memory over the full matrices it holds, DP=1 over DP=2 time; where the owner
  step's time goes (profiler); the load average before and after.
- The exchange bucket size (``benchmarks.buckets``); Muon under tensor parallelism, TP = 2 x DP = 2,
  per ``--muon-tp-mode`` (``benchmarks.tp_modes``); with ``--peers``, the overlap of the exchange
  with NS (``benchmarks.overlap``) and the peers (``benchmarks.peers``).
- 1. Muon optimizer step, owner vs gather, at DP = 1, 2, 4 on Megatron-FSDP row shards, dense and
  MoE (``benchmarks.owner_vs_gather``). 2. Full training step of a Megatron-FSDP GPTModel, Muon vs
  AdamW (``benchmarks.training_step``). 3. Ours vs ``TensorParallelMuon`` and emerging-optimizers
  ``Muon`` at DP=1 (``benchmarks.stock_comparison``, the headline's median repetition). 4. Memory:
  training step, Muon vs AdamW; owner vs gather transient (``benchmarks.memory``). With
  ``--peers``, Muon/AdamW over its ideal ratio as tokens grow (``benchmarks.ideal_ratio``). 5.
  Owner step time as the hidden size doubles (``benchmarks.scaling``). The NS rate against the
  matmul rate. 6. Gram vs standard NS (``benchmarks.ns_methods``), batched vs one-by-one NS
  (``benchmarks.ns_batching``). 9. Every emerging optimizer we run on Megatron-FSDP (muon,
  adaptive_muon, lion, ...), its optimizer step at DP = 1, 2, 4 on the bench GPT next to
  megatron-core's own at DP=1 (``benchmarks.fsdp_optimizers``).

``--section KEY`` (repeatable) runs only those sections, in the order above; one that reads an
earlier section's figures needs it named too (``memory`` reads ``optimizer_step``'s), and the
derived ones (``stock_comparison``, ``matmul_peak``) are not offered: they need the whole run.

Writes ``DIR/results.json`` and ``DIR/results.md`` (default ``bench_out/``) and prints a table.
On CPU each rank runs one thread; DP = 4 on 2 cores oversubscribes, so read ratios measured in one
run, not absolute times.
On a GPU (``--device cuda``) the run is ``benchmarks.gpu_run``'s instead: sizes that mean something
on an 80 GB card (a 1B+ GPT at seq 4096, NS at hidden 4096-8192), one GPU, its own targets;
``--section`` there names its sections (``benchmarks.gpu_config.SECTION_NAMES``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import (
    buckets,
    fsdp_optimizers,
    headline,
    ideal_ratio,
    memory,
    ns_batching,
    ns_methods,
    overlap,
    owner_vs_gather,
    peers,
    scaling,
    stock_comparison,
    tp_modes,
    training_step,
)
from benchmarks.config import FULL, QUICK, BenchConfig
from benchmarks.gpu_config import SECTION_NAMES as GPU_SECTION_NAMES
from benchmarks.machine import LIBRARY_NOTICE, choose_ns_precision, device_name, git_commit
from benchmarks.optimizer_step import MUON_KWARGS
from benchmarks.section import RunContext, missing_figures

__all__ = ["SECTIONS", "format_markdown", "format_report", "main", "required_figures"]

# The full run's stated time on 2 CPU cores, by the NS precision ``choose_ns_precision`` picks,
# each measured with nothing else running: bf16 NS about 11 minutes on an Intel Xeon with AMX and
# 23 min 18 s on an AMD EPYC with avx512_bf16 (2026-11-27, the peers section 852 s of it); fp32
# NS, where bf16 is emulated, 35 minutes (2-core AMD EPYC, 2026-11-26). Since then the
# fsdp_optimizers section, which took 670 s of a whole `make bench` of 2146 s on that AMD EPYC
# (2026-11-27, nothing else running; SOAP's steps most of it). fp32 NS: 44 minutes before that
# section, estimated 55 with it (not measured).
STATED_MINUTES = {"medium": 36, "highest": 55}

# In the order they run and are shown; a section may read the figures of those before it.
SECTIONS = (
    headline.SECTION,
    buckets.SECTION,
    tp_modes.SECTION,
    overlap.SECTION,
    peers.SECTION,
    owner_vs_gather.SECTION,
    training_step.SECTION,
    stock_comparison.SECTION,
    fsdp_optimizers.SECTION,
    memory.SECTION,
    ideal_ratio.SECTION,
    scaling.SECTION,
    headline.MATMUL_PEAK,
    ns_methods.SECTION,
    ns_batching.SECTION,
)
CPU_SECTION_KEYS = tuple(section.key for section in SECTIONS if not section.derived)


def required_figures(with_peers: bool, only: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every figure a run must hold: those of each section it runs (``--peers``: all; ``only``:
    the sections of these keys)."""
    return tuple(
        figure
        for section in SECTIONS
        if (with_peers or not section.peers) and (not only or section.key in only)
        for figure in section.figures
    )


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
    parser.add_argument(
        "--section",
        action="append",
        default=[],
        choices=[*CPU_SECTION_KEYS, *(k for k in GPU_SECTION_NAMES if k not in CPU_SECTION_KEYS)],
        help="run only this section (repeatable; e.g. --quick --section fsdp_optimizers; with "
        f"--device cuda one of {', '.join(GPU_SECTION_NAMES)})",
    )
    args = parser.parse_args(argv)
    keys = CPU_SECTION_KEYS if args.device == "cpu" else GPU_SECTION_NAMES
    if wrong := [key for key in args.section if key not in keys]:
        parser.error(f"--section {', '.join(wrong)}: not a section of --device {args.device}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if args.device == "cuda":
        from benchmarks import gpu_run

        return gpu_run.main(args.out, quick=args.quick, only=tuple(args.section))
    config = QUICK if args.quick else FULL
    context = RunContext(config, args.device, list(config.dp_sizes), Path(args.out), args.quick)
    context.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict = {"machine": choose_ns_precision(args.device)}
    stated_minutes = STATED_MINUTES[results["machine"]["ns_precision"]]
    _print_machine(results["machine"], config)
    load_before = os.getloadavg()
    section_seconds: dict[str, float] = {}
    only = tuple(args.section)
    for section in SECTIONS:
        if section.key not in only if only else section.peers and not args.peers:
            continue
        if section.derived:
            results[section.key] = section.run(context, results)
            continue
        start = time.monotonic()
        print(f"[bench] {section.key} ...", flush=True)
        results[section.key] = section.run(context, results)
        section_seconds[section.key] = time.monotonic() - start
        print(
            f"[bench] {section.key}: {section_seconds[section.key]:.0f} s "
            f"(run {time.monotonic() - started:.0f} s of ~{stated_minutes} min)",
            flush=True,
        )
    results["meta"] = _meta(context, time.monotonic() - started, load_before, section_seconds)
    missing = missing_figures(results, required_figures(args.peers or bool(only), only))
    if missing:
        raise RuntimeError(f"results lack figures: {missing}")
    (context.out_dir / "results.json").write_text(json.dumps(results, indent=2))
    (context.out_dir / "results.md").write_text(format_markdown(results) + "\n")
    print()
    print(format_report(results))
    return 0


def _meta(
    context: RunContext, seconds: float, load_before: tuple, section_seconds: dict[str, float]
) -> dict:
    """What ran where: ``results.json``'s ``meta``."""
    config = context.config
    return {
        "device": context.device,
        "device_name": device_name(context.device),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": context.quick,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "git_commit": git_commit(),
        "muon_kwargs": MUON_KWARGS,
        "warmup": config.warmup,
        "repeats": config.repeats,
        "peer_repeats": config.peer_repeats,
        "dp_sizes": context.dp_sizes,
        # CPU ranks are processes: every DP size runs (the GPU run is benchmarks.gpu_run's).
        "dp_sizes_skipped_for_lack_of_devices": [],
        "seconds": seconds,
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "section_seconds": section_seconds,
        "results_path": str(context.out_dir / "results.json"),
    }


def format_report(results: dict) -> str:
    """The run as the terminal table: a header line, then each section's lines."""
    meta = results["meta"]
    lines = [
        f"megatron-muon benchmarks: {meta['device_name']}, {meta['date']}, "
        f"{'quick' if meta['quick'] else 'full'} run, {meta['seconds']:.0f} s",
        "",
    ]
    for section in SECTIONS:
        if section.key in results:
            lines += section.report(results)
    lines.append(f"results: {meta['results_path']}")
    return "\n".join(lines)


def format_markdown(results: dict) -> str:
    """The run as Markdown tables (``results.md``; what docs/benchmarks.md records)."""
    meta = results["meta"]
    out = [
        f"Device: {meta['device_name']}. Date: {meta['date']}. Commit {meta['git_commit']}, "
        f"torch {meta['torch']}. Median of {meta['repeats']} steps after {meta['warmup']} "
        f"warm-up; the whole run took {meta['seconds']:.0f} s.",
        "",
    ]
    for section in SECTIONS:
        if section.key in results:
            out += section.markdown(results)
    return "\n".join(out)


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


if __name__ == "__main__":
    raise SystemExit(main())

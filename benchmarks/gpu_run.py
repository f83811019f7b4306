"""``python -m benchmarks --device cuda``: the figures a GPU user asks for, on one GPU (DP = 1).

Each section runs in its own spawned process (``run_ranks``, one NCCL rank), in this order:

1. ``matmul``: the card's bf16 matmul rate (``GPU.matmul_size`` cubed), the baseline of 2 and 3.
2. ``newton_schulz``: NS alone (``orthogonalize``, Megatron's default "medium": bf16 matmuls) on
   matrices of hidden 4096 and 8192: TFLOP/s and the fraction of the matmul rate.
3. ``stock``: ``ShardedMuon`` (on Megatron-FSDP row shards, DP = 1) against megatron-core
   ``TensorParallelMuon`` and emerging-optimizers ``Muon`` on full copies of the same weights
   (``GPU.stock``), stepped in turn; and the owner step's NS rate (its NS FLOPs over its time).
4. ``gram``: Gram vs standard NS by aspect ratio (``benchmarks.ns_methods`` on the GPU; Gram in
   fp16, its default, and in bf16).
5. ``symmetric``: symmetric vs standard NS (``ns_method="symmetric"``: its symmetric products as
   three half-size GEMMs each) on the shapes of 2, in bf16 and in fp32: whether it pays on this
   card, which decides the default NS method (docs/newton_schulz.md).
6. ``training``: a 1B+ GPTModel (``GPU.gpt``, seq 4096) under Megatron-FSDP, bf16 compute weights,
   Muon (``build_muon_optimizer``) and AdamW (megatron-core's), each kind in its own process:
   median whole step, optimizer step, peak memory (``max_memory_allocated``) and state memory.
7. ``syrk``: emerging-optimizers' Triton syrk NS (``--muon-use-syrk``) against the standard NS on
   the shapes of 2, in bf16, where it runs; last, each shape in a launch of its own under
   ``SYRK_SHAPE_TIMEOUT_S`` (its kernels compile and autotune on each shape's first call: 83-94 s
   at (4096, 4096) on an H100), so that a shape that finished survives one that did not.
8. ``prediction``: the plan tool's per-rank NS FLOPs and bytes of the same model at DP = 8-64,
   priced at the rates measured above (module ``benchmarks.gpu_targets``).

The targets (``benchmarks.gpu_targets.TARGETS``) are reported met or not, with the figures behind
each. ``results.json`` is rewritten after every section (``"partial": true`` in its ``meta`` until
the run ends), so a run stopped from outside keeps every finished section's figures. On CPU the
same code runs at ``QUICK_CPU`` sizes (``tests/test_gpu_benchmarks.py``).
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import gpu_targets, ns_methods
from benchmarks.gpu_config import GPU, QUICK_CPU, SECTION_NAMES, GpuBenchConfig
from benchmarks.headline import owner_step
from benchmarks.launcher import run_ranks
from benchmarks.machine import device_name, git_commit
from benchmarks.measure import interleaved_times, median, synchronize, timed
from benchmarks.models import GPTSize, TransformerShapes
from benchmarks.optimizer_step import matmul_rate
from benchmarks.stock_comparison import stock_comparison
from benchmarks.training_step import Trainer

__all__ = ["run", "main"]

# The syrk section's bound per shape: its Triton kernels compile and autotune on each shape's first
# call. On an H200 (2026-11-27) the section, then inside the symmetric one, had not finished after
# 190 s and the run stopped there with no figure kept; on an H100 the same day the first call at
# (4096, 4096) took 83 s and again 94 s, so 240 s for the four shapes of ``GPU.ns_shapes`` kept one.
# Each shape now runs in a launch of its own (its process start and imports count too), and
# ``scripts/gpu_check.sh`` gives the section a slot of its own (``GPU_CHECK_ONLY=syrk``).
SYRK_SHAPE_TIMEOUT_S = 130.0


# --------------------------------------------------------------------------------------------------
# rank bodies (one rank)
# --------------------------------------------------------------------------------------------------


def newton_schulz_rates(
    rank: int,
    world_size: int,
    device: str,
    shapes: list[tuple[int, int]],
    warmup: int,
    repeats: int,
) -> list[dict]:
    """NS seconds and FLOP/s of each ``(rows, cols)`` fp32 matrix at Megatron's default precision
    ("medium": bf16 matmuls), the standard method, 5 quintic steps."""
    from megatron_muon.newton_schulz.methods import NSConfig, orthogonalize

    config = NSConfig()
    torch.set_float32_matmul_precision("medium")
    rows_out = []
    for rows, cols in shapes:
        x = torch.randn(rows, cols, device=device)
        for _ in range(warmup):
            orthogonalize(x, config)
        seconds = median(
            [timed(lambda x=x: orthogonalize(x, config), device) for _ in range(repeats)]
        )
        flops = config.flops(rows, cols)
        rows_out.append(
            {
                "shape": [rows, cols],
                "seconds": seconds,
                "flops": flops,
                "flops_per_s": flops / seconds,
            }
        )
    return rows_out


def _ns_seconds(x: torch.Tensor, configs: tuple, warmup: int, repeats: int) -> list[float]:
    """Median seconds of ``orthogonalize(x, config)`` for each of ``configs`` (``NSConfig``),
    timed alternately (``interleaved_times``) on ``x``'s device."""
    from megatron_muon.newton_schulz.methods import orthogonalize

    calls = [lambda config=config: orthogonalize(x, config) for config in configs]
    return [median(t) for t in interleaved_times(calls, warmup, repeats, x.device.type)]


def symmetric_vs_standard(
    rank: int,
    world_size: int,
    device: str,
    shapes: list[tuple[int, int]],
    warmup: int,
    repeats: int,
) -> list[dict]:
    """Standard and symmetric NS (5 quintic steps) of each ``(rows, cols)`` fp32 matrix, timed
    alternately (``interleaved_times``), at "medium" (bf16 matmuls, Megatron's default) and
    "highest" (fp32, no TF32): median seconds of each, their ratio and the FLOP ratio."""
    from megatron_muon.newton_schulz.methods import NSConfig

    standard, symmetric = NSConfig(), NSConfig(ns_method="symmetric")
    rows_out = []
    for precision in ("medium", "highest"):
        torch.set_float32_matmul_precision(precision)
        for rows, cols in shapes:
            x = torch.randn(rows, cols, device=device)
            standard_s, symmetric_s = _ns_seconds(x, (standard, symmetric), warmup, repeats)
            rows_out.append(
                {
                    "shape": [rows, cols],
                    "precision": precision,
                    "standard_s": standard_s,
                    "symmetric_s": symmetric_s,
                    "symmetric_over_standard": symmetric_s / standard_s,
                    "flop_ratio": symmetric.flops(rows, cols) / standard.flops(rows, cols),
                }
            )
    return rows_out


def syrk_vs_standard(
    rank: int,
    world_size: int,
    device: str,
    shapes: list[tuple[int, int]],
    warmup: int,
    repeats: int,
) -> dict:
    """emerging-optimizers' Triton syrk NS (``--muon-use-syrk``) against the standard NS on each
    ``(rows, cols)`` fp32 matrix, timed alternately at "medium" (its only precision: it runs the
    dense iteration under "high"/"highest"): ``{"problem": None, "rows": [...]}``, or where it
    cannot run ``{"problem": why, "rows": []}``. Each shape's first call compiles (and autotunes)
    its Triton kernels: the section runs last, a launch per shape (``_syrk_section``)."""
    from megatron_muon.newton_schulz.methods import NSConfig, orthogonalize
    from megatron_muon.newton_schulz.syrk import syrk_problem

    if (problem := syrk_problem(device)) is not None:
        return {"problem": problem, "rows": []}
    standard, syrk = NSConfig(), NSConfig(use_syrk=True)
    torch.set_float32_matmul_precision("medium")
    rows_out = []
    for rows, cols in shapes:
        x = torch.randn(rows, cols, device=device)
        compile_s = timed(lambda x=x: orthogonalize(x, syrk), device)
        standard_s, syrk_s = _ns_seconds(x, (standard, syrk), warmup, repeats)
        rows_out.append(
            {
                "shape": [rows, cols],
                "standard_s": standard_s,
                "syrk_s": syrk_s,
                "syrk_over_standard": syrk_s / standard_s,
                "first_call_s": compile_s,
            }
        )
        print(f"[gpu bench] syrk {rows}x{cols}: {rows_out[-1]}", flush=True)
    return {"problem": None, "rows": rows_out}


def stock_and_owner(
    rank: int, world_size: int, device: str, shapes: TransformerShapes, warmup: int, repeats: int
) -> dict:
    """Section 3: the stock comparison, then the owner step alone (NS FLOPs over its time)."""
    stock = stock_comparison(rank, world_size, device, shapes, warmup, repeats)
    if device == "cuda":
        torch.cuda.empty_cache()
    owner = owner_step(rank, world_size, device, shapes, warmup, repeats)
    return {"stock_s": stock["seconds"], "owner": owner}


def training_kind(
    rank: int, world_size: int, device: str, size: GPTSize, kind: str, warmup: int, repeats: int
) -> dict:
    """Section 5 for one optimizer kind, in a process of its own: median step and optimizer-step
    seconds, forward+backward seconds, and memory (bytes): state (before a step) and step peak."""
    trainer = Trainer(size, world_size, device, kind)
    for _ in range(warmup):
        trainer.timed_step()
    samples = [trainer.timed_step() for _ in range(repeats)]
    synchronize(device)
    dist.barrier()
    result = {
        "step_s": median([whole for whole, _ in samples]),
        "optimizer_s": median([opt for _, opt in samples]),
    }
    result["forward_backward_s"] = result["step_s"] - result["optimizer_s"]
    if kind == "muon":
        result["ns_flops"] = trainer.muon_ns_flops()
    if device == "cuda":
        result["state_bytes"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        trainer.timed_step()
        result["peak_bytes"] = torch.cuda.max_memory_allocated()
    return result


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------


def _gram_section(config: GpuBenchConfig, device: str) -> list[dict]:
    timings = [
        ns_methods.time_shape(
            (config.gram_k, ratio * config.gram_k),
            precision,
            warmup=config.warmup,
            repeats=config.repeats,
            device=device,
        )
        for precision in ("fp16", "bf16")
        for ratio in config.gram_ratios
    ]
    return [asdict(t) for t in timings]


def _training_section(config: GpuBenchConfig, device: str) -> dict:
    out: dict = {"model": asdict(config.gpt), "tokens_per_rank": config.gpt.tokens_per_rank()}
    for kind in ("muon", "adamw"):
        (out[kind],) = run_ranks(
            training_kind, 1, device, config.gpt, kind, config.warmup, config.repeats
        )
    return out


def _syrk_section(config: GpuBenchConfig, device: str, log) -> dict:
    """Section 7, each shape of ``config.ns_shapes`` in a launch of its own bounded by
    ``SYRK_SHAPE_TIMEOUT_S``: ``{"problem": why or None, "rows": [...]}``, a shape that failed or
    outlasted its bound a row ``{"shape", "error"}``."""
    out: dict = {"problem": None, "rows": []}
    for shape in config.ns_shapes:
        try:
            result = run_ranks(
                syrk_vs_standard,
                1,
                device,
                [shape],
                config.warmup,
                config.repeats,
                timeout=SYRK_SHAPE_TIMEOUT_S,
            )[0]
        except Exception as error:  # noqa: BLE001 - reported; the next shape still runs
            out["rows"].append({"shape": list(shape), "error": f"{type(error).__name__}: {error}"})
            log(f"[gpu bench] syrk {shape}: {type(error).__name__}: {error}")
            continue
        if result["problem"] is not None:
            return result
        out["rows"] += result["rows"]
    return out


def run(
    device: str,
    config: GpuBenchConfig,
    log=print,
    on_section=None,
    only: tuple[str, ...] = (),
) -> dict:
    """Every section in order (``only``: those of these names, ``SECTION_NAMES``); a section that
    raises (or outlasts its launch's time bound) is recorded (``"error"``) and the rest run.
    ``on_section(results)`` after each section, so that a run stopped from outside keeps what
    finished."""
    sections = {
        "matmul": lambda: run_ranks(matmul_rate, 1, device, config.matmul_size, config.repeats)[0],
        "newton_schulz": lambda: run_ranks(
            newton_schulz_rates, 1, device, list(config.ns_shapes), config.warmup, config.repeats
        )[0],
        "stock": lambda: run_ranks(
            stock_and_owner, 1, device, config.stock, config.warmup, config.repeats
        )[0],
        "gram": lambda: _gram_section(config, device),
        "symmetric": lambda: run_ranks(
            symmetric_vs_standard, 1, device, list(config.ns_shapes), config.warmup, config.repeats
        )[0],
        "training": lambda: _training_section(config, device),
        "syrk": lambda: _syrk_section(config, device, log),
    }
    assert tuple(sections) == SECTION_NAMES
    results: dict = {"config": asdict(config), "section_seconds": {}}
    for name, section in sections.items():
        if only and name not in only:
            continue
        start = time.monotonic()
        try:
            results[name] = section()
        except Exception as error:  # noqa: BLE001 - reported, and the other sections still run
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            log(traceback.format_exc())
        results["section_seconds"][name] = time.monotonic() - start
        log(f"[gpu bench] {name}: {results['section_seconds'][name]:.1f} s")
        if on_section is not None:
            on_section(results)
    results["prediction"] = gpu_targets.predict(results, config)
    results["targets"] = gpu_targets.verdicts(results)
    return results


def main(out_dir: str, quick: bool, device: str = "cuda", only: tuple[str, ...] = ()) -> int:
    """Runs the GPU benchmark (``only``: those sections); writes ``results.json`` and
    ``results.md`` under ``out_dir``."""
    config = QUICK_CPU if quick and device == "cpu" else GPU
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def save_so_far(results: dict) -> None:
        partial = {
            **results,
            "meta": {**_meta(device, time.monotonic() - started), "partial": True},
        }
        (out / "results.json").write_text(json.dumps(partial, indent=2))

    results = run(device, config, on_section=save_so_far, only=only)
    results["meta"] = _meta(device, time.monotonic() - started)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    text = gpu_targets.format_markdown(results)
    (out / "results.md").write_text(text + "\n")
    print(text)
    errors = [
        name for name, value in results.items() if isinstance(value, dict) and "error" in value
    ]
    return 1 if errors else 0


def _meta(device: str, seconds: float) -> dict:
    return {
        "device": device,
        "device_name": device_name(device),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "git_commit": git_commit(),
        "seconds": seconds,
        "statistics": "median of repeats after warmup",
    }

"""First in ``make bench``: the machine's matmul rates, and the NS precision they pick.

One thread's fp32 and bf16 matmul rates (``megatron_muon.newton_schulz.matmul_rates``, 512^3)
decide the run's NS
precision: Megatron's default "medium" (bf16 NS matmuls) where bf16 runs within
``BF16_SLOW_FACTOR`` of fp32, else "highest" (fp32): on a CPU without bf16 instructions bf16 NS is
tens of times slower and the run would not finish in its time (measured: a DP=2 owner step past
600 s on a Zen 3 core). The choice goes to every rank through ``NS_PRECISION_ENV`` (set before the
first rank starts) and into ``results.json`` (``machine``), with the rates and the reason.

The ranks' library notices (Transformer Engine / Apex not installed, deprecations, Megatron-FSDP's
device notes) and the PyTorch profiler's log lines are said once here and silenced in the ranks
(``quiet_rank``). ``device_name`` and
``git_commit`` say where and on what code a run ran (``results.json``'s ``meta``, CPU and GPU runs).
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import warnings
from collections.abc import Callable
from typing import Any

import torch

from megatron_muon.newton_schulz.matmul_rates import (
    BF16_SLOW_FACTOR,
    bf16_is_slow,
    measure_matmul_rates,
)

__all__ = ["choose_ns_precision", "device_name", "git_commit", "quiet_rank", "LIBRARY_NOTICE"]

LIBRARY_NOTICE = (
    "library warnings in the ranks (Transformer Engine / Apex not installed, deprecations, "
    "Megatron-FSDP's device notes, the profiler's log lines) are silenced"
)
# Kineto, the PyTorch profiler's backend, logs at each profiled call (the headline's time split,
# every transient-memory figure): "profiler_start" / "profiler_stop" (its USDT level) and, on a
# CUDA build of torch without a GPU, "ERROR ... gpuGetDeviceCount failed with code 35" (no CUDA
# driver) although only CPU activities are profiled. Its levels run from 0 (verbose) to 5 (USDT);
# 6 logs none. Read when a profiler first starts, so setting it in the rank is in time.
KINETO_LOG_LEVEL_ENV = "KINETO_LOG_LEVEL"
KINETO_SILENT = "6"


def choose_ns_precision(device: str) -> dict:
    """Measures the rates (CPU) and returns ``{"rates", "ns_precision", "reason"}``; exports the
    precision to the ranks (``benchmarks.optimizer_step.NS_PRECISION_ENV``)."""
    from benchmarks import optimizer_step

    if device == "cuda":
        choice = {"rates": None, "ns_precision": "medium", "reason": "GPU: bf16 tensor cores"}
    else:
        rates = measure_matmul_rates(size=512)
        slow = bf16_is_slow(rates)
        choice = {
            "rates": {name: rate for name, rate in rates.items()},
            "ns_precision": "highest" if slow else "medium",
            "reason": (
                f"bf16 over {BF16_SLOW_FACTOR:.0f}x slower than fp32 here: NS in fp32"
                if slow
                else "bf16 about as fast as fp32 here: Megatron's default, NS in bf16"
            ),
        }
    os.environ[optimizer_step.NS_PRECISION_ENV] = choice["ns_precision"]
    # The ranks' launcher process imports megatron at start: its import notices too, and torch's
    # log records below ERROR ("No CUDA runtime is found" where there is no GPU).
    os.environ["PYTHONWARNINGS"] = "ignore"
    os.environ.setdefault("TORCH_LOGS", "-torch")
    optimizer_step.MUON_KWARGS["fp32_matmul_prec"] = choice["ns_precision"]
    return choice


def quiet_rank(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """A rank body: ``fn(rank, world_size, *args)`` with Python warnings, log records below ERROR
    and the profiler's log lines off (``benchmarks.launcher.run_ranks`` launches every body
    through it). ``KINETO_LOG_LEVEL`` set beforehand (e.g. 0, to debug the profiler) is kept."""
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault(KINETO_LOG_LEVEL_ENV, KINETO_SILENT)
    return fn(rank, world_size, *args)


def device_name(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    model = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, 1 thread per rank"


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"

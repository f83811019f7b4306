"""What the optimizer-step sections share (run inside ranks): Megatron-LM's Muon settings, row-shard
params, alternating timing, transient memory, the matmul rate.

The sections (``benchmarks.owner_vs_gather``, ``benchmarks.stock_comparison``,
``benchmarks.scaling``, ``benchmarks.buckets``, ...) build their params with ``sharded_params``,
warm up, then alternate the optimizers being compared step by step (``time_alternating``: machine
noise hits both alike) and report per-rank medians and ``StepStats``. Grads are fixed random
tensors: the step's cost does not depend on their values. ``matmul_rate`` is a rank body for
``benchmarks.launcher.run_ranks``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from benchmarks.measure import MemoryProbe, median, tensor_memory_peak, timed
from benchmarks.models import ShapeModel, TransformerShapes, shard_like_megatron_fsdp

__all__ = [
    "MUON_KWARGS",
    "matmul_rate",
    "owner_step_figures",
    "peak_step_memory",
    "sharded_params",
    "time_alternating",
    "time_samples",
]

# The run's NS precision: ``python -m benchmarks`` sets it from the machine's measured matmul rates
# before any rank starts (``benchmarks.machine``); Megatron's default "medium" (bf16) otherwise.
NS_PRECISION_ENV = "MEGATRON_MUON_BENCH_NS_PREC"
# Megatron-LM's effective Muon defaults (its --muon-* flags' defaults), NS precision as above.
MUON_KWARGS = dict(
    lr=3e-4,
    momentum=0.95,
    nesterov=False,
    weight_decay=0.01,
    fp32_matmul_prec=os.environ.get(NS_PRECISION_ENV, "medium"),
    coefficient_type="quintic",
    num_ns_steps=5,
    scale_mode="spectral",
    tp_mode="blockwise",
)


def sharded_params(shapes: TransformerShapes, world_size: int, device: str) -> list[torch.Tensor]:
    """The Shard(0) DTensor params Megatron-FSDP hands the optimizer, with random row grads."""
    from torch.distributed.tensor import DTensor

    model = ShapeModel(shapes)
    wrapped = shard_like_megatron_fsdp(model, world_size, torch.device(device))
    params = list(wrapped.parameters())
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    for p in params:
        local = p.to_local()
        if local.shape[0] == 0:
            p.grad = None  # what Megatron-FSDP leaves on a rank holding no rows
            continue
        grad = torch.randn(local.shape, generator=generator).to(local.device)
        p.grad = DTensor.from_local(
            grad, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return params


def time_samples(
    optimizers: dict, device: str, warmup: int, repeats: int
) -> dict[str, list[float]]:
    """Step seconds of each optimizer, ``repeats`` each, stepping them in turn (order rotated each
    round) after ``warmup`` untimed rounds."""
    names = list(optimizers)
    for _ in range(warmup):
        for name in names:
            optimizers[name].step()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds[name].append(timed(optimizers[name].step, device))
    return seconds


def time_alternating(optimizers: dict, device: str, warmup: int, repeats: int) -> dict:
    """Median step seconds of each optimizer, stepping them in turn (``time_samples``)."""
    samples = time_samples(optimizers, device, warmup, repeats)
    return {name: median(values) for name, values in samples.items()}


def peak_step_memory(optimizers: dict, device: str) -> dict:
    """Peak tensor memory above the pre-step level during one step of each optimizer, bytes.

    CPU: live tensor bytes from the profiler's allocation records; GPU: ``max_memory_allocated``.
    """
    peaks = {}
    for name, optimizer in optimizers.items():
        dist.barrier()
        if device == "cpu":
            peaks[name] = tensor_memory_peak(optimizer.step, device)
        else:
            probe = MemoryProbe(device)
            probe.start()
            optimizer.step()
            peaks[name] = probe.peak_above_start()
        dist.barrier()
    return peaks


def owner_step_figures(optimizers: dict, device: str, warmup: int, repeats: int) -> dict:
    """``{name: {seconds, transient_bytes, held_bytes}}`` of owner-mode ``ShardedMuon`` variants on
    the same params: median step time (stepped in turn), one step's transient memory and the full
    matrices held at once (``StepStats.peak_full_matrix_bytes``)."""
    seconds = time_alternating(optimizers, device, warmup, repeats)
    memory = peak_step_memory(optimizers, device)
    return {
        name: {
            "seconds": seconds[name],
            "transient_bytes": memory[name],
            "held_bytes": optimizer.step_stats.peak_full_matrix_bytes,
        }
        for name, optimizer in optimizers.items()
    }


def matmul_rate(rank: int, world_size: int, device: str, size: int, repeats: int) -> dict:
    """Measured matmul FLOP/s of one rank (one thread on CPU) in the dtype of the run's NS matmuls
    (bf16 under "medium", fp32 otherwise): the NS efficiency baseline."""
    dtype = torch.bfloat16 if MUON_KWARGS["fp32_matmul_prec"] == "medium" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    seconds = median([timed(lambda: a @ b, device) for _ in range(repeats)])
    return {
        "size": size,
        "dtype": str(dtype).removeprefix("torch."),
        "flops_per_s": 2 * size**3 / seconds,
    }

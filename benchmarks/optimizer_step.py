"""Optimizer-step benchmarks (run inside ranks): owner vs gather, ours vs stock, growth with size.

Every public function here but the helpers ``sharded_params``, ``time_alternating`` and
``peak_step_memory`` is a rank body for ``benchmarks.launcher.run_ranks``: it builds the params,
warms up, then alternates the optimizers being compared step by step (so machine noise hits both
alike) and returns per-rank medians and ``StepStats``. Grads are fixed random tensors: the step's
cost does not depend on their values.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import torch
import torch.distributed as dist

from benchmarks.measure import MemoryProbe, median, tensor_memory_peak, timed
from benchmarks.models import ShapeModel, TransformerShapes, shard_like_megatron_fsdp

__all__ = [
    "MUON_KWARGS",
    "matmul_rate",
    "owner_step_figures",
    "owner_vs_gather",
    "peak_step_memory",
    "sharded_params",
    "time_alternating",
    "time_samples",
    "stock_comparison",
    "size_scaling",
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
            mode: ShardedMuon(params, mode=mode, **MUON_KWARGS) for mode in ("owner", "gather")
        }
        seconds = time_alternating(optimizers, device, warmup, repeats)
        stats = {mode: asdict(opt.step_stats) for mode, opt in optimizers.items()}
        bucketed = ShardedMuon(
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


def stock_comparison(
    rank: int, world_size: int, device: str, shapes: TransformerShapes, warmup: int, repeats: int
) -> dict:
    """ShardedMuon vs megatron-core TensorParallelMuon vs emerging-optimizers Muon, full params.

    One rank (``world_size == 1``); each optimizer has its own copy of the same params and grads.
    """
    from emerging_optimizers.orthogonalized_optimizers.muon import Muon
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from megatron_muon import ShardedMuon

    if world_size != 1:
        raise ValueError(f"the stock comparison runs on one rank, got {world_size}")
    generator = torch.Generator().manual_seed(0)
    fulls = [torch.randn(*shape, generator=generator).to(device) for shape in shapes.shapes()]
    grads = [torch.randn(*shape, generator=generator).to(device) for shape in shapes.shapes()]

    def copies() -> list[torch.nn.Parameter]:
        params = [torch.nn.Parameter(f.clone()) for f in fulls]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        return params

    emerging_kwargs = {k: v for k, v in MUON_KWARGS.items() if k != "tp_mode"}
    optimizers = {
        "ours": ShardedMuon(copies(), **MUON_KWARGS),
        "tensor_parallel_muon": TensorParallelMuon(copies(), **MUON_KWARGS),
        "emerging_muon": Muon(copies(), **emerging_kwargs),
    }
    return {"seconds": time_alternating(optimizers, device, warmup, repeats)}


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

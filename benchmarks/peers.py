"""Peers: each peer Muon's exactness and optimizer-step time next to ours (docs/benchmarks.md).

Exactness: the peer's parameters after 3 steps on FSDP2 (``fully_shard``) Shard(0) params against
one single-process fp32 reference (megatron-core ``TensorParallelMuon`` on the full matrices,
``"highest"``), and a bf16 (``"medium"``) one (not where bf16 matmuls are slow), each peer set to
our settings where it can be and both sides changed where it cannot (``PEER_SETTINGS``). Step time:
ours (``ShardedMuon`` on Megatron-FSDP row shards, with each NS method of ``OURS_SIDES``) and
every peer that ran, on the same shapes,
stepped in turn (median, min, max) with one step's transient memory. A peer that does not install or
refuses this machine is a row with its reason, measured by trying: muonium's NS is a Triton kernel
that asserts CUDA tensors; torchtitan's ``DistMuon`` refuses anything but one CUDA device per
process; a peer whose NS is bf16 only (``BF16_ONLY_NS``) is a row with that reason where bf16
matmuls are slow. megatron-core's ``LayerWiseDistributedOptimizer`` runs on Megatron's DDP with a
whole GPTModel (``benchmarks.layerwise_peer``). Per side and DP: also one step's matmul FLOPs (NS)
and bytes handed to collectives per rank, max and mean over the ranks, counted while it runs
(``benchmarks.step_counts``), the same way for every implementation.
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.distributed as dist

from benchmarks.layerwise_peer import OURS_SIDES
from benchmarks.models import GPTSize, TransformerShapes
from benchmarks.optimizer_step import MUON_KWARGS, NS_PRECISION_ENV, sharded_params
from benchmarks.section import RunContext, Section
from benchmarks.step_counts import step_figures
from megatron_muon.newton_schulz.matmul_rates import BF16_SLOW_FACTOR

__all__ = [
    "SECTION",
    "peer_exactness",
    "peer_import_errors",
    "peer_step_times",
    "peers_section",
]

STEPS = 3
# Our settings changed, on both sides, where a peer cannot follow. Scale: muon-fsdp2's is
# max(1, rows/cols) ** 0.5 (rms_scale=False, megatron-core's "shape_scaling") or
# 0.2 * max(rows, cols) ** 0.5 (rms_scale=True), muonium's the former; megatron-core's "spectral"
# (our default) is max(rows, cols) ** 0.5. Weight decay: muonium scales it by that shape factor
# (p -= lr * ratio * (u + wd * p)), megatron-core does not, so it is off for muonium.
PEER_SETTINGS: dict[str, dict] = {
    "muon-fsdp2": {"scale_mode": "shape_scaling"},
    "muonium": {"scale_mode": "shape_scaling", "weight_decay": 0.0},
    "torchtitan DistMuon": {},
}
# Peers whose Newton-Schulz runs in bf16 whatever the settings, with where: where bf16 matmuls are
# slow (benchmarks.machine: a CPU without bf16 instructions) their steps would not finish in the
# bench's time (measured on a 2-core AMD EPYC, bf16 57x slower than fp32: muon-fsdp2's exactness
# run at DP=2 past 600 s), so they are rows with that reason there.
BF16_ONLY_NS = {"muon-fsdp2": "muon_fsdp2.zeropower_via_newtonschulz5 casts to bf16"}
PEER_MODULES = {
    "muon-fsdp2": "muon_fsdp2",
    "muonium": "muonium",
    "torchtitan DistMuon": "torchtitan.distributed.flex_shard.dist_muon",
}


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor], start: list[torch.Tensor]):
    """max over matrices of max |got - want| / max |want - start| (relative to the update)."""
    return max(
        float((g - w).abs().max() / (w - s).abs().max())
        for g, w, s in zip(got, want, start, strict=True)
    )


def _reference(fulls, grads, precision: str, peer_settings: dict) -> list[torch.Tensor]:
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    settings = {**MUON_KWARGS, **peer_settings, "fp32_matmul_prec": precision}
    optimizer = TensorParallelMuon(params, **settings)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in params]


def _fsdp2_params(fulls: list[torch.Tensor], device: str, world_size: int):
    """``fulls`` as FSDP2 (``fully_shard``) Shard(0) DTensor params (mesh axis ``dp_shard``), and
    their mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module = torch.nn.Module()
    module.weights = torch.nn.ParameterList([torch.nn.Parameter(f.clone()) for f in fulls])
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("dp_shard",))
    fully_shard(module, mesh=mesh)
    return list(module.weights), mesh


def _muon_fsdp2(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    import muon_fsdp2

    kwargs = {**MUON_KWARGS, **PEER_SETTINGS["muon-fsdp2"]}
    group = dict(
        params=params,
        lr=kwargs["lr"],
        momentum=kwargs["momentum"],
        weight_decay=kwargs["weight_decay"],
        nesterov=kwargs["nesterov"],
        ns_steps=kwargs["num_ns_steps"],
        rms_scale=False,
        use_muon=True,
    )
    return muon_fsdp2.Muon([group])


def _muonium(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    import muonium

    kwargs = {**MUON_KWARGS, **PEER_SETTINGS["muonium"]}
    return muonium.Muon(
        params,
        lr=kwargs["lr"],
        wd=kwargs["weight_decay"],
        use_cautious_wd=False,
        momentum=kwargs["momentum"],
        nesterov=kwargs["nesterov"],
        ns_steps=kwargs["num_ns_steps"],
        orthogonalization_strategy="newton_schulz",
    )


def _dist_muon(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """torchtitan's ``DistMuon``: each whole matrix ``Owned`` by one rank of ``dp_shard`` (its
    docstring's owner layout), one bucket."""
    from torchtitan.distributed.flex_shard.dist_muon import build_dist_muon
    from torchtitan.distributed.flex_shard.optimizer_reshard import (
        BucketConfig,
        ComputeLayout,
        Owned,
    )

    kwargs = {**MUON_KWARGS, **PEER_SETTINGS["torchtitan DistMuon"]}
    names = [f"weights.{index}" for index in range(len(params))]
    owned = ComputeLayout(shardings_by_mesh_axis={"dp_shard": Owned()})
    return build_dist_muon(
        [{"params": params, "param_names": names}],
        compute_sharding_by_fqn=dict.fromkeys(names, owned),
        bucket_configs=[BucketConfig(patterns=("*",))],
        lr=kwargs["lr"],
        weight_decay=kwargs["weight_decay"],
        momentum=kwargs["momentum"],
        nesterov=kwargs["nesterov"],
        ns_steps=kwargs["num_ns_steps"],
    )


# Each peer on FSDP2 params, set to our settings where it can be (PEER_SETTINGS).
PEER_BUILDERS = {"muon-fsdp2": _muon_fsdp2, "muonium": _muonium, "torchtitan DistMuon": _dist_muon}


def peer_exactness(
    rank: int,
    world_size: int,
    device: str,
    shapes: TransformerShapes,
    peer: str,
    steps: int = STEPS,
    bf16_reference: bool = True,
) -> dict:
    """Rank function: ``peer`` on FSDP2 Shard(0) params vs the fp32 and (``bf16_reference``)
    bf16 references.

    Every rank makes the same full matrices and grads (seeded); rank 0 returns the relative errors
    (the others ``{}``), or ``{"not_run": reason}`` where the peer refuses to build or step here.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    generator = torch.Generator().manual_seed(0)
    fulls = [torch.randn(shape, generator=generator) for shape in shapes.shapes()]
    grads = [[torch.randn(f.shape, generator=generator) for f in fulls] for _ in range(steps)]
    params, mesh = _fsdp2_params(fulls, device, world_size)
    try:
        optimizer = PEER_BUILDERS[peer](params)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            optimizer.step()
    except Exception as error:  # the reason is the figure (every rank fails alike)
        return {"not_run": _reason(error)} if rank == 0 else {}
    got = [p.detach().full_tensor() for p in params]
    dist.barrier()
    if rank != 0:
        return {}  # the references are computed once, on rank 0
    settings = PEER_SETTINGS[peer]
    fp32 = _reference(fulls, grads, "highest", settings)
    result = {
        "error_vs_fp32": _relative_error(got, fp32, fulls),
        "update_max_peer_over_reference": max(
            float((g - f).abs().max() / (w - f).abs().max())
            for g, w, f in zip(got, fp32, fulls, strict=True)
        ),
    }
    if bf16_reference:
        bf16 = _reference(fulls, grads, "medium", settings)
        result["error_vs_bf16"] = _relative_error(got, bf16, fulls)
    return result


def _reason(error: Exception) -> str:
    """The exception's type and first line, plus the failing assertion where there is one (a
    torch.compile'd peer wraps it in pages of advice)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    asserts = [line for line in lines[1:] if line.startswith("assert ")]
    return text + (f" ... {asserts[0]}" if asserts else "")


def peer_step_times(
    rank: int,
    world_size: int,
    device: str,
    shapes: TransformerShapes,
    peers: list[str],
    warmup: int,
    repeats: int,
) -> dict:
    """Rank function: optimizer-step seconds (median, min, max; stepped in turn) and one step's
    transient memory of ours (``ShardedMuon`` on Megatron-FSDP row shards) and each of ``peers``
    (on FSDP2 Shard(0) params), on the same shapes and random grads. Rank 0's figures."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from megatron_muon import ShardedMuon

    optimizers = {
        side: ShardedMuon.from_keywords(
            sharded_params(shapes, world_size, device), **MUON_KWARGS, ns_method=method
        )
        for side, method in OURS_SIDES.items()
    }
    generator = torch.Generator().manual_seed(0)
    fulls = [torch.randn(shape, generator=generator) for shape in shapes.shapes()]
    for peer in peers:
        params, mesh = _fsdp2_params(fulls, device, world_size)
        for p in params:
            p.grad = distribute_tensor(torch.randn_like(p.full_tensor()), mesh, [Shard(0)])
        optimizers[peer] = PEER_BUILDERS[peer](params)
    return step_figures(optimizers, device, warmup, repeats)


def peer_import_errors() -> dict[str, str | None]:
    """Each peer that cannot be imported here, with the error (None: it imports)."""
    errors: dict[str, str | None] = {}
    for name, module in PEER_MODULES.items():
        try:
            importlib.import_module(module)
            errors[name] = None
        except Exception as error:  # reported, never dropped: the reason is the figure
            errors[name] = f"{type(error).__name__}: {error}"
    return errors


def peers_section(
    shapes: TransformerShapes,
    gpt: GPTSize,
    device: str,
    dp_sizes: list[int],
    warmup: int,
    repeats: int,
) -> dict:
    """Each peer's exactness after 3 steps and its step time next to ours at each DP >= 2 (rows
    with a reason where a peer cannot run: not installed, or refusing this machine): the FSDP2
    peers on ``shapes``' matrices, megatron-core's LayerWise on the ``gpt`` model
    (``benchmarks.layerwise_peer``)."""
    from benchmarks.launcher import run_ranks
    from benchmarks.layerwise_peer import layerwise_section

    rows: dict[str, dict] = {}
    for name, error in peer_import_errors().items():
        if error is not None:
            rows[name] = {"not_run": f"not installed (make bench-peers-deps): {error}"}
    slow_bf16 = os.environ.get(NS_PRECISION_ENV) == "highest"  # benchmarks.machine's finding
    for name, where in BF16_ONLY_NS.items():
        if slow_bf16 and name not in rows:
            rows[name] = {
                "not_run": f"its Newton-Schulz runs in bf16 only ({where}) and bf16 matmuls are "
                f"over {BF16_SLOW_FACTOR:.0f}x slower than fp32 here: its steps would not finish "
                "in the bench's time"
            }
    runnable = [name for name in PEER_BUILDERS if name not in rows]
    timings: dict[str, dict] = {}
    for dp in [dp for dp in dp_sizes if dp >= 2]:
        for name in runnable:
            result = run_ranks(peer_exactness, dp, device, shapes, name, STEPS, not slow_bf16)[0]
            rows.setdefault(name, {})[str(dp)] = result
        timed = [name for name in runnable if "not_run" not in rows[name][str(dp)]]
        times = run_ranks(peer_step_times, dp, device, shapes, timed, warmup, repeats)[0]
        for name in timed:
            for side in OURS_SIDES:
                times[name][f"{side}_over_peer"] = times[side]["seconds"] / times[name]["seconds"]
        timings[str(dp)] = times
    layer_wise = layerwise_section(gpt, device, dp_sizes, warmup, repeats)
    rows["megatron-core LayerWiseDistributedOptimizer"] = layer_wise
    return {
        "model": shapes.describe(),
        "steps": STEPS,
        "settings": PEER_SETTINGS,
        "rows": rows,
        "step_times": timings,
    }


def _run(context: RunContext, results: dict) -> dict:
    config = context.config
    return peers_section(
        config.dense,
        config.gpt,
        context.device,
        context.dp_sizes,
        config.warmup,
        config.peer_repeats,
    )


# No lines of its own: docs/benchmarks.md ("Peers") tabulates results.json.
SECTION = Section(
    key="peers",
    run=_run,
    figures=("peers.rows", "peers.step_times.*.ours.seconds"),
    peers=True,
)

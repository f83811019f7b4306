"""Peers' exactness: each peer Muon's parameters after 3 steps against one single-process fp32
reference (megatron-core ``TensorParallelMuon`` on the full matrices, ``"highest"`` precision).

Built so far: ``muon-fsdp2`` 0.3.0 on torch FSDP2 (``fully_shard``), set to our settings where it
can be (momentum, no Nesterov, weight decay, 5 quintic NS steps). Its scale cannot be
megatron-core's "spectral" (our default), so both sides use ``max(1, rows/cols) ** 0.5``
(``rms_scale=False``; megatron-core's "shape_scaling"). Its NS always runs in bf16 (not
settable), so it is also compared with the reference in bf16 (``"medium"``) to tell that apart from
other differences. ``muonium`` and torchtitan's ``DistMuon`` are reported with the reason they do
not run (``peer_import_errors``). Not built yet: the timing rows and megatron-core's
``LayerWiseDistributedOptimizer`` (docs/benchmarks.md, "Peers").
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from benchmarks.models import TransformerShapes
from benchmarks.optimizer_step import MUON_KWARGS

__all__ = ["muon_fsdp2_exactness", "peer_import_errors"]

STEPS = 3
# Our settings changed where muon-fsdp2 cannot follow: its scales are max(1, rows/cols) ** 0.5
# (rms_scale=False, megatron-core's "shape_scaling") or 0.2 * max(rows, cols) ** 0.5
# (rms_scale=True); megatron-core's "spectral" (our default) is max(rows, cols) ** 0.5.
PEER_SETTINGS = {"scale_mode": "shape_scaling"}
PEER_MODULES = {
    "muonium": "muonium",
    "torchtitan DistMuon": "torchtitan.distributed.flex_shard.dist_muon",
}


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor], start: list[torch.Tensor]):
    """max over matrices of max |got - want| / max |want - start| (relative to the update)."""
    return max(
        float((g - w).abs().max() / (w - s).abs().max())
        for g, w, s in zip(got, want, start, strict=True)
    )


def _reference(fulls, grads, precision: str) -> list[torch.Tensor]:
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    settings = {**MUON_KWARGS, **PEER_SETTINGS, "fp32_matmul_prec": precision}
    optimizer = TensorParallelMuon(params, **settings)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in params]


def muon_fsdp2_exactness(
    rank: int, world_size: int, device: str, shapes: TransformerShapes, steps: int = STEPS
):
    """Rank function: ``muon_fsdp2.Muon`` on FSDP2 Shard(0) params vs the fp32 and bf16 references.

    Every rank makes the same full matrices and grads (seeded); rank 0 returns the relative errors
    (the others ``{}``).
    """
    import muon_fsdp2
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    generator = torch.Generator().manual_seed(0)
    fulls = [torch.randn(shape, generator=generator) for shape in shapes.shapes()]
    grads = [[torch.randn(f.shape, generator=generator) for f in fulls] for _ in range(steps)]
    module = torch.nn.Module()
    module.weights = torch.nn.ParameterList([torch.nn.Parameter(f.clone()) for f in fulls])
    mesh = init_device_mesh(device, (world_size,))
    fully_shard(module, mesh=mesh)
    params = list(module.weights)
    kwargs = MUON_KWARGS
    optimizer = muon_fsdp2.Muon(
        [
            dict(
                params=params,
                lr=kwargs["lr"],
                momentum=kwargs["momentum"],
                weight_decay=kwargs["weight_decay"],
                nesterov=kwargs["nesterov"],
                ns_steps=kwargs["num_ns_steps"],
                rms_scale=False,
                use_muon=True,
            )
        ]
    )
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        optimizer.step()
    got = [p.detach().full_tensor() for p in params]
    dist.barrier()
    if rank != 0:
        return {}  # the references are computed once, on rank 0
    fp32 = _reference(fulls, grads, "highest")
    return {
        "error_vs_fp32": _relative_error(got, fp32, fulls),
        "error_vs_bf16": _relative_error(got, _reference(fulls, grads, "medium"), fulls),
        "update_max_peer_over_reference": max(
            float((g - f).abs().max() / (w - f).abs().max())
            for g, w, f in zip(got, fp32, fulls, strict=True)
        ),
    }


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


def peers_section(shapes: TransformerShapes, device: str, dp_sizes: list[int]) -> dict:
    """Exactness of each peer after 3 steps at each DP >= 2 (rows with a reason where one cannot
    run: not installed, or failing on this machine)."""
    from benchmarks.launcher import run_ranks

    rows: dict[str, dict] = {"muon-fsdp2": {}}
    try:
        importlib.import_module("muon_fsdp2")
    except ImportError as error:
        rows["muon-fsdp2"] = {"not_run": f"not installed (make bench-peers-deps): {error}"}
    else:
        for dp in [dp for dp in dp_sizes if dp >= 2]:
            rows["muon-fsdp2"][str(dp)] = run_ranks(muon_fsdp2_exactness, dp, device, shapes)[0]
    for name, error in peer_import_errors().items():
        reason = (
            error
            or "imports; its run is not built yet (a first attempt found it needs Triton/CUDA)"
        )
        rows[name] = {"not_run": reason}
    rows["megatron-core LayerWiseDistributedOptimizer"] = {"not_run": "not built yet"}
    return {"model": shapes.describe(), "steps": STEPS, "settings": PEER_SETTINGS, "rows": rows}

"""Rank bodies of the GPU tests (``tests/test_gpu.py``): one NCCL rank on ``cuda:0``, no stand-in.

Each function runs inside ``megatron_muon.testing.run_on_ranks(..., device="cuda")`` and returns
plain numbers for the test to assert on, so that a failure message shows what was measured.
"""

from __future__ import annotations

import torch

from tests import gpt_parity

STEPS = 3


def _check_no_stand_ins() -> None:
    from megatron_muon import cpu_stand_ins

    if cpu_stand_ins.installed():
        raise AssertionError("a CPU stand-in is active in a GPU run")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def sharded_vs_tensor_parallel_muon(rank: int, world_size: int) -> dict:
    """``ShardedMuon`` on Megatron-FSDP row shards (CUDA DTensors) vs megatron-core
    ``TensorParallelMuon`` on full copies, ``STEPS`` steps, at each ``fp32_matmul_prec``.

    Returns ``{prec: worst relative error over params}`` and ``"medium_vs_highest"``: the stock
    optimizer's own gap between its "medium" (bf16 NS) and "highest" (fp32 NS) results, the floor
    that "medium" is held to.
    """
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from benchmarks.models import TransformerShapes
    from benchmarks.optimizer_step import MUON_KWARGS, sharded_params
    from megatron_muon import ShardedMuon

    _check_no_stand_ins()
    shapes = TransformerShapes(num_layers=2, hidden=256, ffn_hidden=1024)
    results: dict[str, float] = {}
    stock_results: dict[str, list[torch.Tensor]] = {}
    for prec in ("highest", "medium"):
        kwargs = {**MUON_KWARGS, "fp32_matmul_prec": prec}
        params = sharded_params(shapes, world_size, "cuda")
        fulls = [torch.nn.Parameter(p.full_tensor().clone()) for p in params]
        grads = [p.grad.full_tensor().clone() for p in params]
        ours = ShardedMuon.from_keywords(params, **kwargs)
        stock = TensorParallelMuon(fulls, **kwargs)
        for _ in range(STEPS):
            for p, g in zip(fulls, grads, strict=True):
                p.grad = g.clone()
            ours.step()
            stock.step()
        if not all(p.full_tensor().is_cuda for p in params):
            raise AssertionError("ShardedMuon moved a param off the GPU")
        results[prec] = max(
            _relative(p.full_tensor(), f) for p, f in zip(params, fulls, strict=True)
        )
        stock_results[prec] = [f.detach().clone() for f in fulls]
    results["medium_vs_highest"] = max(
        _relative(m, h)
        for m, h in zip(stock_results["medium"], stock_results["highest"], strict=True)
    )
    return results


def momentum_offload_is_bitwise(rank: int, world_size: int) -> dict:
    """``MuonFsdpConfig(offload_momentum=True)`` vs without, ``STEPS`` steps on CUDA row shards:
    returns the largest absolute param difference and whether the host copies are pinned."""
    from benchmarks.models import TransformerShapes
    from benchmarks.optimizer_step import MUON_KWARGS, sharded_params
    from megatron_muon import ShardedMuon

    _check_no_stand_ins()
    shapes = TransformerShapes(num_layers=2, hidden=256, ffn_hidden=1024)
    plain, offloaded = (sharded_params(shapes, world_size, "cuda") for _ in range(2))
    optimizers = [
        ShardedMuon.from_keywords(plain, **MUON_KWARGS),
        ShardedMuon.from_keywords(offloaded, offload_momentum=True, **MUON_KWARGS),
    ]
    for _ in range(STEPS):
        for optimizer in optimizers:
            optimizer.step()
    hosts = list(optimizers[1]._offload._host.values())
    return {
        "max_abs_diff": max(
            float((a.full_tensor() - b.full_tensor()).abs().max())
            for a, b in zip(plain, offloaded, strict=True)
        ),
        "num_offloaded": len(hosts),
        "all_pinned": all(h.is_pinned() for h in hosts),
        "device_bytes_freed": all(
            m.untyped_storage().size() == 0 for m in optimizers[1]._offload._host
        ),
    }


def _bf16_rounded_gpt() -> torch.nn.Module:
    """The fp32 tiny GPT with every weight rounded to bf16 (values stay fp32)."""
    model = gpt_parity.build_gpt()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    return model


def factory_gpt_bf16(rank: int, world_size: int, steps: int) -> dict:
    """``build_muon_optimizer`` + its step wrapper on a GPTModel under Megatron-FSDP
    (optim_grads_params, bf16 compute weights, fp32 main weights; the wrapper calls
    ``finish_grad_sync``), against the fp32 reference of ``tests.gpt_parity`` on the GPU.

    The floor is measured in the same run: the same reference with its forward and backward under
    bf16 autocast, against the fp32 reference. Errors are of the update (params after ``steps``
    steps minus the initial params), relative, over all params as one vector and over the Muon
    matrices alone.
    """
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel

    from megatron_muon import build_muon_optimizer

    _check_no_stand_ins()
    gpt_parity.init_megatron()
    # Every run starts from the bf16 model's weights: the fp32 init rounded to bf16, as
    # use_cpu_initialization casts it (so ours and the references start from equal weights).
    initial = {n: p.detach().cuda() for n, p in _bf16_rounded_gpt().named_parameters()}
    references = {}
    for autocast in (False, True):
        reference = gpt_parity.Reference(_bf16_rounded_gpt().cuda())
        for step in range(steps):
            tokens, labels = (t.cuda() for t in gpt_parity.batch(step, world_size))
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                reference.step(tokens, labels)
        references[autocast] = dict(reference.model.named_parameters())

    from megatron.core.transformer.module import Float16Module

    # bf16 compute weights as Megatron-LM's get_model makes them: Float16Module casts the module.
    inner = gpt_parity.build_gpt(bf16=True)
    model = Float16Module(inner.config, inner).cuda()
    ddp_config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params",
        use_megatron_fsdp=True,
        gradient_reduce_div_fusion=False,
    )
    wrapped = FullyShardedDataParallel(model.config, ddp_config, model, device=torch.device("cuda"))
    optimizer = build_muon_optimizer(
        gpt_parity.optimizer_config(bf16=True), [wrapped], grads_already_synced=False
    )
    for step in range(steps):
        tokens, labels = (t.cuda() for t in gpt_parity.batch(step, world_size))
        optimizer.zero_grad()
        gpt_parity.loss_of(wrapped, tokens, labels).backward()
        ok, _, _ = optimizer.step()
        if not ok:
            raise AssertionError(f"step {step} was skipped")
    ours = {
        gpt_parity._strip(n): p.full_tensor() if hasattr(p, "full_tensor") else p
        for n, p in wrapped.named_parameters()
    }
    # Relative error of the whole update (all params as one vector), and of the Muon matrices'.
    updates = {"ours": [], "reference": [], "autocast": []}
    matrices = {"ours": [], "reference": [], "autocast": []}
    for name, start in initial.items():
        for kind, param in (
            ("ours", ours[name]),
            ("reference", references[False][name]),
            ("autocast", references[True][name]),
        ):
            delta = (param.detach().float() - start).flatten()
            updates[kind].append(delta)
            if gpt_parity.reference_routes_to_muon(name, start):
                matrices[kind].append(delta)
    whole = {k: torch.cat(v) for k, v in updates.items()}
    muon = {k: torch.cat(v) for k, v in matrices.items()}
    return {
        "error": _relative(whole["ours"], whole["reference"]),
        "floor": _relative(whole["autocast"], whole["reference"]),
        "muon_error": _relative(muon["ours"], muon["reference"]),
        "muon_floor": _relative(muon["autocast"], muon["reference"]),
        "num_params": len(updates["ours"]),
        "compute_dtype": str(next(iter(model.parameters())).dtype),
    }

"""build_muon_optimizer with ``optimizer="psgd_pro"`` and ``"rekls"`` on a real Megatron-FSDP
GPTModel.

One launch (2 gloo ranks) trains the tiny GPTModel of tests/test_factory_soap.py under
megatron-core's ``FullyShardedDataParallel`` (optim_grads_params) for 5 steps with each optimizer,
next to a single-process fp32 reference on full tensors: emerging-optimizers' ``REKLS`` (the
keywords megatron-core's registry gives it: ``lr``, ``weight_decay``, ``betas`` = the Adam betas,
``rekls_shampoo_beta``), or ``PSGDPro`` stepping each matrix on the random stream
``ShardedPSGDPro`` gives it (seed ``i * 2**31 + step_seed``, ``optimizers.psgd_pro``), on the 2-D
hidden matrices, + AdamW on the rest; stepped with the sharded run's own gradients (why:
tests/test_factory_soap.py). The matrices are bitwise the reference's; the AdamW params
(megatron-core's foreach AdamW against torch's per-tensor loop) within 1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.factory_gpt_runs import PARITY_STEPS
from tests.gpt_parity import SEQ, Run
from tests.soap_reference import EAGER

NAMES = ("psgd_pro", "rekls")
SHAMPOO_BETA = 0.9
WARMUP_STEPS = 3


def _reference_optimizers(name: str, model: torch.nn.Module) -> tuple[list, list]:
    """(the matrices' reference optimizers, one per matrix for PSGDPro), [AdamW] on full
    tensors; the matrices as megatron-core routes them."""
    from emerging_optimizers.psgd import PSGDPro
    from emerging_optimizers.soap import REKLS

    named = list(model.named_parameters())
    matrices = [p for n, p in named if gpt_parity.reference_routes_to_muon(n, p)]
    others = [p for n, p in named if not gpt_parity.reference_routes_to_muon(n, p)]
    common = dict(lr=gpt_parity.LR, weight_decay=gpt_parity.WEIGHT_DECAY)
    if name == "rekls":
        matrix = [REKLS(matrices, betas=gpt_parity.BETAS, shampoo_beta=SHAMPOO_BETA, **common)]
    else:
        matrix = [PSGDPro([p], warmup_steps=WARMUP_STEPS, **common) for p in matrices]
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in others if p.ndim >= 2], "weight_decay": gpt_parity.WEIGHT_DECAY},
            {"params": [p for p in others if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=gpt_parity.LR,
        betas=gpt_parity.BETAS,
        eps=gpt_parity.EPS,
    )
    return matrix, [adamw]


def _train_run(name: str, rank: int, world_size: int) -> dict:
    from megatron_muon import build_muon_optimizer
    from megatron_muon.checkpointing import leaf_optimizers
    from megatron_muon.engine.owner_compute import OwnerComputedOptimizer

    config = gpt_parity.optimizer_config(optimizer=name)
    config.rekls_shampoo_beta = SHAMPOO_BETA  # as install() carries --rekls-shampoo-beta over
    config.psgd_pro_warmup_steps = WARMUP_STEPS
    reference_model = gpt_parity.build_gpt()
    matrix_references, others = _reference_optimizers(name, reference_model)
    wrapped = gpt_parity.wrap(
        gpt_parity.build_gpt(), Run("mcore", "optim_grads_params"), world_size
    )
    named = dict(wrapped.named_parameters())  # the optimizer params, right after wrapping
    optimizer = build_muon_optimizer(config, [wrapped])
    (owned,) = [o for o in leaf_optimizers(optimizer) if isinstance(o, OwnerComputedOptimizer)]
    reference_params = dict(reference_model.named_parameters())
    names = {id(p): gpt_parity._strip(n) for n, p in named.items()}
    # PSGDPro: the reference of the sharded optimizer's matrix i is the one of its param.
    order = [reference_params[names[id(p)]] for p in owned._all_params()]
    by_param = {id(o.param_groups[0]["params"][0]): o for o in matrix_references}
    for step in range(PARITY_STEPS):
        tokens, labels = gpt_parity.batch(step, world_size)
        mine = tokens.view(world_size, -1, SEQ)[rank], labels.view(world_size, -1, SEQ)[rank]
        optimizer.zero_grad()
        gpt_parity.loss_of(wrapped, *mine).backward()
        ok, _, _ = optimizer.step()
        assert ok
        for param_name, grad in gpt_parity.whole_by_name(named, "grad").items():
            reference_params[param_name].grad = grad
        if name == "rekls":
            matrix_references[0].step()
        for i, param in enumerate(order if name == "psgd_pro" else []):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(i * 2**31 + owned.step_seed)
                by_param[id(param)].step()
        others[0].step()
    ours = gpt_parity.whole_by_name(named, "data")
    compared = {n: (ours[n], p.detach().clone()) for n, p in reference_params.items()}
    routed = {gpt_parity._strip(r.name): r.optimizer for r in optimizer.routing}
    return {"params": compared, "routed": routed, "summary": list(optimizer.summary_lines)}


def _train(rank: int, world_size: int) -> dict:
    gpt_parity.init_megatron()
    with EAGER():
        return {name: _train_run(name, rank, world_size) for name in NAMES}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_on_ranks(_train, 2, timeout=600)[0]


@pytest.mark.multirank
@pytest.mark.parametrize("name", NAMES)
def test_gpt_steps_as_the_unsharded_stock_optimizer(results, name: str) -> None:
    result = results[name]
    label = {"psgd_pro": "PSGDPro", "rekls": "REKLS"}[name]
    assert any(f"{label}[dense]" in line for line in result["summary"]), result["summary"]
    routed = result["routed"]
    assert sum(o == name for o in routed.values()) == 8, routed  # 4 matrices x 2 layers
    for param_name, (ours, reference) in result["params"].items():
        if routed[param_name] == name:
            assert torch.equal(ours, reference), param_name
        else:
            error = float((ours - reference).norm() / reference.norm().clamp_min(1e-12))
            assert error <= 1e-6, (param_name, error)

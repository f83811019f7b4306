"""build_muon_optimizer with ``optimizer="soap"`` on a real Megatron-FSDP GPTModel.

One launch (2 gloo ranks) trains the tiny GPTModel of tests/test_factory.py under megatron-core's
``FullyShardedDataParallel`` for 5 steps under each sharding strategy (no_shard, optim,
optim_grads, optim_grads_params), next to a single-process fp32 reference: emerging-optimizers'
``SOAP`` with the keywords megatron-core's registry gives it for ``--optimizer soap`` (``lr``,
``weight_decay``, ``betas`` = the Adam betas, ``shampoo_beta``, ``use_kl_shampoo``) on the 2-D
hidden matrices + AdamW on the rest, on full tensors, stepped with the sharded run's own
gradients (the rows of every rank, assembled, after the optimizer's clipping).

Why the sharded run's gradients, not the reference's own backward (as the Muon parity tests do):
SOAP's first step is Adam in the eigenbasis of ``L = G G^T``, whose null space (a ``(192, 64)``
``linear_qkv`` has 128 zero eigenvalues) holds only rounding noise; Adam divides that noise by its
own magnitude (eps 1e-8), so a gradient that differs in its last bit gives an O(1) different
update there. Measured: the same reference with its batch gradient accumulated in another order
(the "reduction-order floor" of the other tests) moves ``linear_qkv`` by 1.6 (relative) in 5 steps.
With the same gradients, SOAP's arithmetic is the same on the owner as in the reference: the SOAP
params are bitwise the reference's at every strategy; the AdamW params (megatron-core's foreach
AdamW against torch's per-tensor loop) within 1e-6 relative. Both run eager
(``tests.soap_reference.EAGER``). In the same launch, the MoE GPT (4 experts, their rows over
``expt_dp``: a second ``ShardedSOAP`` over that group, for every expert's fc1 and fc2; the router
is a dense SOAP matrix on both sides) under optim_grads_params, compared the same way.
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.factory_gpt_runs import PARITY_STEPS
from tests.fsdp_models import STRATEGIES
from tests.gpt_parity import SEQ, Run
from tests.soap_reference import EAGER, SHAMPOO_BETA, SoapReference

# (run, MoE GPT): every strategy on the dense GPT, and the MoE GPT (4 experts, their rows over
# ``expt_dp``: a second ShardedSOAP) under optim_grads_params.
RUNS = [(Run("mcore", strategy), False) for strategy in STRATEGIES]
RUNS.append((Run("mcore", "optim_grads_params"), True))


def _train_run(run: Run, moe: bool, rank: int, world_size: int) -> dict:
    """name -> (ours, the reference's) whole param after ``PARITY_STEPS`` steps; routing and
    summary."""
    from megatron_muon import build_muon_optimizer

    config = gpt_parity.optimizer_config(optimizer="soap", soap_shampoo_beta=SHAMPOO_BETA)
    reference = SoapReference(gpt_parity.build_gpt(moe))
    wrapped = gpt_parity.wrap(gpt_parity.build_gpt(moe), run, world_size)
    named = dict(wrapped.named_parameters())  # the optimizer params, right after wrapping
    optimizer = build_muon_optimizer(config, [wrapped])
    reference_params = dict(reference.model.named_parameters())
    for step in range(PARITY_STEPS):
        tokens, labels = gpt_parity.batch(step, world_size)
        mine = tokens.view(world_size, -1, SEQ)[rank], labels.view(world_size, -1, SEQ)[rank]
        optimizer.zero_grad()
        gpt_parity.loss_of(wrapped, *mine).backward()
        ok, _, _ = optimizer.step()
        assert ok
        for name, grad in gpt_parity.whole_by_name(named, "grad").items():
            reference_params[name].grad = grad
        for reference_optimizer in reference.optimizers:
            reference_optimizer.step()
    ours = gpt_parity.whole_by_name(named, "data")
    compared = {name: (ours[name], p.detach().clone()) for name, p in reference_params.items()}
    routed = {gpt_parity._strip(r.name): (r.optimizer, r.is_expert) for r in optimizer.routing}
    return {"params": compared, "routed": routed, "summary": list(optimizer.summary_lines)}


def _train(rank: int, world_size: int) -> list[dict]:
    gpt_parity.init_megatron()
    with EAGER():
        return [_train_run(run, moe, rank, world_size) for run, moe in RUNS]


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return run_on_ranks(_train, 2, timeout=600)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "index",
    range(len(RUNS)),
    ids=[run.strategy + ("-moe" if moe else "") for run, moe in RUNS],
)
def test_soap_gpt_steps_as_the_unsharded_stock_optimizer(results, index: int) -> None:
    result = results[0][index]
    summary = result["summary"]
    assert any("SOAP[dense]" in line for line in summary), summary
    routed = {name: optimizer for name, (optimizer, _) in result["routed"].items()}
    if RUNS[index][1]:
        expert = [line for line in summary if "SOAP[expert]" in line]
        assert len(expert) == 1 and "over expt_dp (2 ranks)" in expert[0], summary
        experts = [n for n, (o, is_expert) in result["routed"].items() if is_expert and o == "soap"]
        assert len(experts) == 2 * gpt_parity.NUM_EXPERTS * 2, routed  # layers x experts x fc
    else:
        assert sum(o == "soap" for o in routed.values()) == 8, routed  # 4 matrices x 2 layers
    for name, (ours, reference) in result["params"].items():
        if routed[name] == "soap":
            assert torch.equal(ours, reference), name
        else:
            error = float((ours - reference).norm() / reference.norm().clamp_min(1e-12))
            assert error <= 1e-6, (name, error)

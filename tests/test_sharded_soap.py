"""ShardedSOAP equals emerging-optimizers' ``SOAP`` on the full matrices; its owner plan.

Each rank steps a row-sharded copy (uneven and empty shards; a rank with no rows has ``grad is
None``) and ``SOAP`` on the full params side by side, three steps with fresh grads (the first
refreshes the eigenbases by ``eigh``, the later ones by QR), with and without KL-Shampoo. The owner
assembles the same fp32 gradient and runs SOAP's own per-matrix functions on it, so params and every
state tensor (gathered from their owners) are bitwise the reference's. The one-rank case runs in
this process, without torch.distributed. Both run eager (``EAGER``), as the torchrun launches of
tests/torchrun.py do (``TORCHDYNAMO_DISABLE``): compiling emerging-optimizers' Adam update for each
shape costs ~15 s a process on 2 cores, and the same functions run either way.
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.muon_reference import full_tensor
from tests.row_split_parity import offsets, set_sharded_grad, sharded_param
from tests.soap_reference import EAGER

# Tall, wide, odd sizes; with 3 ranks the middle rank holds nothing of the first.
SHAPES = [(24, 8), (8, 20), (13, 7)]
SPLITS_3 = [[8, 0, 16], [2, 3, 3], [4, 4, 5]]
KWARGS = dict(lr=0.01, betas=(0.9, 0.95), shampoo_beta=0.9, eps=1e-8, weight_decay=0.1)
STEPS = 3
KEYS = ("exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R")


def _reference(fulls: list[torch.Tensor], use_kl_shampoo: bool):
    from emerging_optimizers.soap import SOAP

    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    return params, SOAP(params, use_kl_shampoo=use_kl_shampoo, **KWARGS)


def _grads(step: int) -> list[torch.Tensor]:
    return [full_tensor(shape, seed=1000 * step + i + 100) for i, shape in enumerate(SHAPES)]


def _differences(params, optimizer, reference_params, reference, starts) -> list[str]:
    """What differs from the reference: this rank's param rows, and each state tensor it owns."""
    from megatron_muon.engine.layout import local_tensor

    found = []
    for i, (p, ref, start) in enumerate(zip(params, reference_params, starts, strict=True)):
        local = local_tensor(p.detach())
        if not torch.equal(local, ref.detach()[start : start + local.shape[0]]):
            found.append(f"param {i}")
        for key in KEYS:
            mine = local_tensor(optimizer.state[p][key])
            if mine.shape[0] and not torch.equal(mine, reference.state[ref][key]):
                found.append(f"{key} of param {i}")
        if optimizer.state[p]["step"] != reference.state[ref]["step"]:
            found.append(f"step of param {i}")
    return found


def _run(rank: int, world_size: int) -> dict:
    with EAGER():
        return _run_eager(rank, world_size)


def _run_eager(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_muon.optimizers.soap import ShardedSOAP

    mesh = init_device_mesh("cpu", (world_size,))
    starts = [offsets(rows)[rank] for rows in SPLITS_3]
    fulls = [full_tensor(shape, seed=i) for i, shape in enumerate(SHAPES)]
    results = {}
    for use_kl_shampoo in (True, False):
        params = [
            sharded_param(f, rows, rank, mesh) for f, rows in zip(fulls, SPLITS_3, strict=True)
        ]
        reference_params, reference = _reference(fulls, use_kl_shampoo)
        optimizer = ShardedSOAP(params, use_kl_shampoo=use_kl_shampoo, **KWARGS)
        for step in range(STEPS):
            for p, ref, rows, grad in zip(
                params, reference_params, SPLITS_3, _grads(step), strict=True
            ):
                ref.grad = grad.clone()
                set_sharded_grad(p, grad, rows, rank, none_if_empty=True)
            optimizer.step()
            reference.step()
        results[use_kl_shampoo] = {
            "differences": _differences(params, optimizer, reference_params, reference, starts),
            "owners": optimizer.owner_plan().owners,
            "owned": [bool(optimizer.state[p]["L"].to_local().shape[0]) for p in params],
            "state_bytes": optimizer.local_state_bytes(),
            "planned_bytes": optimizer.owner_plan().state_bytes[rank],
        }
    return results


def test_one_rank_without_torch_distributed_is_bitwise_soap() -> None:
    from megatron_muon.optimizers.soap import ShardedSOAP

    fulls = [full_tensor(shape, seed=i) for i, shape in enumerate(SHAPES)]
    for use_kl_shampoo in (True, False):
        params = [torch.nn.Parameter(f.clone()) for f in fulls]
        reference_params, reference = _reference(fulls, use_kl_shampoo)
        optimizer = ShardedSOAP(params, use_kl_shampoo=use_kl_shampoo, **KWARGS)
        with EAGER():
            for step in range(STEPS):
                for p, ref, grad in zip(params, reference_params, _grads(step), strict=True):
                    ref.grad, p.grad = grad.clone(), grad.clone()
                optimizer.step()
                reference.step()
        starts = [0] * len(params)
        assert _differences(params, optimizer, reference_params, reference, starts) == []


@pytest.mark.multirank
def test_uneven_and_empty_row_shards_are_bitwise_soap_on_full_matrices() -> None:
    results = run_on_ranks(_run, 3)
    for rank, by_case in enumerate(results):
        for case, result in by_case.items():
            assert result["differences"] == [], (rank, case, result["differences"])
            # The state lives on the plan's owner alone.
            assert result["owned"] == [owner == rank for owner in result["owners"]], (rank, case)
            assert result["state_bytes"] == result["planned_bytes"], (rank, case)


def test_owner_plan_balances_state_bytes_and_is_a_function_of_shapes() -> None:
    from megatron_muon.optimizers.soap_plan import plan_soap_owners

    # The CPU bench's dense GPT (benchmarks/config.py): 8 layers, hidden 512, MLP 2048.
    hidden, ffn = 512, 2048
    shapes = [(3 * hidden, hidden), (hidden, hidden), (ffn, hidden), (hidden, ffn)] * 8
    plan = plan_soap_owners(shapes, 4)
    assert plan.state_max_over_mean <= 1.15, plan
    assert plan.flops_max_over_mean <= 1.15, plan
    assert plan_soap_owners(shapes, 4) == plan


def test_settings_that_cannot_run_exactly_are_refused_naming_them() -> None:
    from megatron_muon.optimizers.soap import ShardedSOAP
    from megatron_muon.optimizers.soap_matrix import SoapConfig

    matrix = [torch.nn.Parameter(torch.zeros(4, 4))]
    with pytest.raises(ValueError, match="weight_decay_method='l2'"):
        ShardedSOAP(matrix, lr=0.1, weight_decay_method="l2")
    with pytest.raises(ValueError, match="SOAP steps real 2-D matrices"):
        ShardedSOAP([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
    with pytest.raises(ValueError, match="precondition_frequency must be 1, got 10"):
        SoapConfig(precondition_frequency=10)
    with pytest.raises(ValueError, match="shampoo_beta must be in"):
        SoapConfig(shampoo_beta=1.0)
    # What the factory builds from megatron-core's OptimizerConfig: refused naming the field.
    from megatron.core.optimizer import OptimizerConfig

    config = OptimizerConfig(optimizer="soap", lr=0.1, soap_precondition_frequency=5)
    with pytest.raises(ValueError, match="soap_precondition_frequency must be 1, got 5"):
        ShardedSOAP.from_optimizer_config(matrix, config, None)
    built = ShardedSOAP.from_optimizer_config(
        matrix, OptimizerConfig(optimizer="soap", lr=0.1), None
    )
    assert (built.use_kl_shampoo, built.param_groups[0]["shampoo_beta"]) == (True, 0.95)

"""ShardedPSGDPro and ShardedREKLS equal emerging-optimizers' ``PSGDPro`` and ``REKLS`` on the
full matrices; PSGDPro's owner plan.

Each rank steps a row-sharded copy (uneven and empty shards; a rank with no rows has ``grad is
None``) beside the optimizer's own class on the full params, three steps with fresh grads. The
owner assembles the same fp32 gradient and runs the class's own per-matrix functions on it, so
params and every state tensor (on their owners) are bitwise the reference's.

REKLS's reference is ``REKLS`` itself. PSGDPro draws random numbers (damping noise, the random
starts of its norm bounds): ``ShardedPSGDPro`` runs each matrix's work on its own stream (seeded
``i * 2**31 + step_seed``, ``step_seed`` one draw from the CPU generator per step;
``optimizers.psgd_pro``), so its reference is ``PSGDPro`` stepping each matrix with the generator
seeded so; every rank and the reference seed the CPU generator alike before each step. The one-rank
case runs in this process, without torch.distributed; one launch of 3 ranks runs both optimizers.
Both sides run eager (``tests.soap_reference.EAGER``).
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
STEPS = 3
KWARGS = {
    "rekls": dict(lr=0.01, betas=(0.9, 0.95), shampoo_beta=0.9, weight_decay=0.1),
    "psgd_pro": dict(lr=0.01, weight_decay=0.1, momentum=0.8, warmup_steps=5),
}
KEYS = {
    "rekls": ("exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R"),
    "psgd_pro": ("exp_avg", "Q_0", "Q_1", "L"),
}


class _PerMatrixPSGDPro:
    """``PSGDPro`` on each full matrix, each stepped with the default generator seeded as
    ``ShardedPSGDPro`` seeds that matrix's stream; ``state`` reads as one optimizer's, its
    ``Q``/``L`` lists under ``ShardedPSGDPro``'s keys."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        from emerging_optimizers.psgd import PSGDPro

        self.params = params
        self.optimizers = [PSGDPro([p], **KWARGS["psgd_pro"]) for p in params]

    def step(self) -> None:
        step_seed = int(torch.randint(2**31 - 1, ()).item())  # the step's one draw
        for i, optimizer in enumerate(self.optimizers):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(i * 2**31 + step_seed)
                optimizer.step()

    @property
    def state(self) -> dict:
        out = {}
        for p, optimizer in zip(self.params, self.optimizers, strict=True):
            s = optimizer.state[p]
            out[p] = {"step": s["step"], "exp_avg": s["exp_avg"], "L": torch.stack(s["L"])}
            out[p].update(Q_0=s["Q"][0], Q_1=s["Q"][1])
        return out


def _reference(name: str, fulls: list[torch.Tensor]):
    from emerging_optimizers.soap import REKLS

    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    if name == "rekls":
        return params, REKLS(params, **KWARGS[name])
    return params, _PerMatrixPSGDPro(params)


def _sharded(name: str, params: list) -> torch.optim.Optimizer:
    from megatron_muon.optimizers.psgd_pro import ShardedPSGDPro
    from megatron_muon.optimizers.rekls import ShardedREKLS

    return {"rekls": ShardedREKLS, "psgd_pro": ShardedPSGDPro}[name](params, **KWARGS[name])


def _grads(step: int) -> list[torch.Tensor]:
    return [full_tensor(shape, seed=1000 * step + i + 100) for i, shape in enumerate(SHAPES)]


def _differences(name, params, optimizer, reference_params, reference, starts) -> list[str]:
    """What differs from the reference: this rank's param rows, and each state tensor it owns."""
    from megatron_muon.engine.layout import local_tensor

    found = []
    state = reference.state
    for i, (p, ref, start) in enumerate(zip(params, reference_params, starts, strict=True)):
        local = local_tensor(p.detach())
        if not torch.equal(local, ref.detach()[start : start + local.shape[0]]):
            found.append(f"param {i}")
        for key in KEYS[name]:
            mine = local_tensor(optimizer.state[p][key])
            if mine.shape[0] and not torch.equal(mine, state[ref][key]):
                found.append(f"{key} of param {i}")
        if optimizer.state[p]["step"] != state[ref]["step"]:
            found.append(f"step of param {i}")
    return found


def _step_both(optimizer, reference, step: int) -> None:
    torch.manual_seed(step)  # every rank and the reference alike
    optimizer.step()
    torch.manual_seed(step)
    reference.step()


def _run(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    starts = [offsets(rows)[rank] for rows in SPLITS_3]
    fulls = [full_tensor(shape, seed=i) for i, shape in enumerate(SHAPES)]
    results = {}
    for name in KWARGS:
        params = [
            sharded_param(f, rows, rank, mesh) for f, rows in zip(fulls, SPLITS_3, strict=True)
        ]
        reference_params, reference = _reference(name, fulls)
        optimizer = _sharded(name, params)
        with EAGER():
            for step in range(STEPS):
                for p, ref, rows, grad in zip(
                    params, reference_params, SPLITS_3, _grads(step), strict=True
                ):
                    ref.grad = grad.clone()
                    set_sharded_grad(p, grad, rows, rank, none_if_empty=True)
                _step_both(optimizer, reference, step)
        key = KEYS[name][-1]
        results[name] = {
            "differences": _differences(
                name, params, optimizer, reference_params, reference, starts
            ),
            "owners": optimizer.owner_plan().owners,
            "owned": [bool(optimizer.state[p][key].to_local().shape[0]) for p in params],
            "state_bytes": optimizer.local_state_bytes(),
            "planned_bytes": optimizer.owner_plan().state_bytes[rank],
        }
    return results


@pytest.mark.parametrize("name", list(KWARGS))
def test_one_rank_without_torch_distributed_is_bitwise_the_unsharded_class(name: str) -> None:
    fulls = [full_tensor(shape, seed=i) for i, shape in enumerate(SHAPES)]
    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    reference_params, reference = _reference(name, fulls)
    optimizer = _sharded(name, params)
    with EAGER():
        for step in range(STEPS):
            for p, ref, grad in zip(params, reference_params, _grads(step), strict=True):
                ref.grad, p.grad = grad.clone(), grad.clone()
            _step_both(optimizer, reference, step)
    starts = [0] * len(params)
    assert _differences(name, params, optimizer, reference_params, reference, starts) == []


@pytest.mark.multirank
def test_uneven_and_empty_row_shards_are_bitwise_the_unsharded_class_on_full_matrices() -> None:
    results = run_on_ranks(_run, 3)
    for rank, by_name in enumerate(results):
        for name, result in by_name.items():
            assert result["differences"] == [], (rank, name, result["differences"])
            # The state lives on the plan's owner alone.
            assert result["owned"] == [owner == rank for owner in result["owners"]], (rank, name)
            assert result["state_bytes"] == result["planned_bytes"], (rank, name)


def test_psgd_owner_plan_balances_state_bytes_and_flops() -> None:
    from megatron_muon.engine.state_owners import plan_state_owners
    from megatron_muon.optimizers.psgd_matrix import psgd_flops, psgd_state_bytes

    # The CPU bench's dense GPT (benchmarks/config.py): 8 layers, hidden 512, MLP 2048.
    hidden, ffn = 512, 2048
    shapes = [(3 * hidden, hidden), (hidden, hidden), (ffn, hidden), (hidden, ffn)] * 8
    plan = plan_state_owners(shapes, 4, psgd_state_bytes, psgd_flops)
    assert plan.state_max_over_mean <= 1.15, plan
    assert plan.flops_max_over_mean <= 1.15, plan
    assert plan_state_owners(shapes, 4, psgd_state_bytes, psgd_flops) == plan


def test_settings_that_cannot_run_exactly_are_refused_naming_them() -> None:
    from megatron.core.optimizer import OptimizerConfig

    from megatron_muon.optimizers.psgd_matrix import PsgdProConfig
    from megatron_muon.optimizers.psgd_pro import ShardedPSGDPro
    from megatron_muon.optimizers.rekls import RekLsConfig, ShardedREKLS

    matrix = [torch.nn.Parameter(torch.zeros(4, 4))]
    with pytest.raises(ValueError, match="weight_decay_method='l2'"):
        ShardedPSGDPro(matrix, lr=0.1, weight_decay_method="l2")
    with pytest.raises(ValueError, match="weight_decay_method='l2'"):
        ShardedREKLS(matrix, lr=0.1, weight_decay_method="l2")
    with pytest.raises(ValueError, match="PSGDPro steps real 2-D matrices"):
        ShardedPSGDPro([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
    with pytest.raises(ValueError, match="beta_lip must be in"):
        PsgdProConfig(beta_lip=1.0)
    with pytest.raises(ValueError, match="shampoo_beta must be in"):
        RekLsConfig(shampoo_beta=-0.1)
    # What the factory builds from megatron-core's OptimizerConfig (+ the flags' fields).
    config = OptimizerConfig(optimizer="psgd_pro", lr=0.1)
    config.psgd_pro_warmup_steps = 0  # type: ignore[attr-defined]  # as integrations sets it
    with pytest.raises(ValueError, match="psgd_pro_warmup_steps must be positive, got 0"):
        ShardedPSGDPro.from_optimizer_config(matrix, config, None)
    config.psgd_pro_warmup_steps = 7  # type: ignore[attr-defined]  # as integrations sets it
    built = ShardedPSGDPro.from_optimizer_config(matrix, config, None)
    assert (built.warmup_steps, built.param_groups[0]["momentum"]) == (7, 0.9)
    config = OptimizerConfig(optimizer="rekls", lr=0.1, adam_beta2=0.99)
    rekls = ShardedREKLS.from_optimizer_config(matrix, config, None)
    assert (rekls.use_eigh, rekls.use_kl_shampoo) == (True, True)
    assert rekls.param_groups[0]["betas"] == (0.9, 0.99)

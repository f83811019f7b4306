"""ShardedPSGDPro's and ShardedREKLS's state: save/resume bitwise, and a DP=2 checkpoint loaded at
DP=1 and DP=3 (an empty shard).

The toy of tests/test_soap_checkpoint.py (a Megatron-FSDP ``ToyMLP``, its matrices trained by the
optimizer, its biases by AdamW), one toy per optimizer, in the same launches. At DP=2 under
``optim``: two steps, a save (``megatron_muon.save_checkpoint``, which keeps each rank's RNG
states: PSGDPro draws its step seed from the CPU generator), two more steps; then, in the same
processes, a fresh toy (another init seed) loads the checkpoint and takes the same two steps:
params and every state tensor bitwise the uninterrupted run's. Then in fresh processes the
checkpoint loads at DP=3 under ``optim_grads_params`` and at DP=1: each matrix's owner changes
with the DP size; every state tensor (taken from its owner) and every param is bitwise the saved
one. Three launches.
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.checkpoint_toys import DIM, WarmupScheduler, full_snapshot, owner_held_state, train
from tests.soap_reference import EAGER

pytestmark = pytest.mark.multirank

NAMES = ("psgd_pro", "rekls")
KWARGS = {
    "psgd_pro": dict(lr=1e-2, weight_decay=0.1, warmup_steps=3),
    "rekls": dict(lr=1e-2, weight_decay=0.1, shampoo_beta=0.9),
}


def _build(name: str, world_size: int, strategy: str, seed: int = 0):
    from megatron_muon.checkpointing import ensure_optimizer_state, named_optimizer_params
    from megatron_muon.optimizers.psgd_pro import ShardedPSGDPro
    from megatron_muon.optimizers.rekls import ShardedREKLS
    from tests.fsdp_models import ToyMLP, fully_shard_toy

    torch.manual_seed(seed)
    wrapped = fully_shard_toy(ToyMLP(dim=DIM, hidden=48), world_size, strategy)
    named = named_optimizer_params(wrapped)
    matrices = [p for _, p in named if p.ndim == 2]
    others = [p for _, p in named if p.ndim == 1]
    matrix_class = {"psgd_pro": ShardedPSGDPro, "rekls": ShardedREKLS}[name]
    optimizers: list = [
        matrix_class(matrices, **KWARGS[name]),
        torch.optim.AdamW(others, lr=1e-2, weight_decay=0.1),
    ]
    ensure_optimizer_state(optimizers)
    return wrapped, optimizers, WarmupScheduler(optimizers)


def _snapshot(wrapped, optimizers) -> dict:
    return {
        "params": full_snapshot(wrapped, optimizers[1:])["params"],  # AdamW: row state
        "owned": owner_held_state(wrapped, optimizers[0]),
    }


def _save_and_resume(rank: int, world_size: int, root: str) -> dict:
    from megatron_muon.checkpointing import load_checkpoint, save_checkpoint

    out = {}
    for name in NAMES:
        path = f"{root}/{name}"
        wrapped, optimizers, scheduler = _build(name, world_size, "optim")
        with EAGER():
            train(wrapped, optimizers, scheduler, rank, world_size, 2, 0, noise=False)
            save_checkpoint(path, wrapped, optimizers, scheduler, iteration=2)
            saved = _snapshot(wrapped, optimizers)
            train(wrapped, optimizers, scheduler, rank, world_size, 2, 2, noise=False)
            uninterrupted = _snapshot(wrapped, optimizers)
            wrapped, optimizers, scheduler = _build(name, world_size, "optim", seed=123)
            load_checkpoint(path, wrapped, optimizers, scheduler)
            train(wrapped, optimizers, scheduler, rank, world_size, 2, 2, noise=False)
            resumed = _snapshot(wrapped, optimizers)
        out[name] = {"saved": saved, "uninterrupted": uninterrupted, "resumed": resumed}
    return out


def _load(rank: int, world_size: int, root: str) -> dict:
    from megatron_muon.checkpointing import load_checkpoint

    out = {}
    for name in NAMES:
        wrapped, optimizers, scheduler = _build(name, world_size, "optim_grads_params", seed=123)
        load_checkpoint(f"{root}/{name}", wrapped, optimizers, scheduler)
        out[name] = {
            **_snapshot(wrapped, optimizers),
            "owners": optimizers[0].owner_plan().owners,
        }
    return out


def _differences(got: dict, expected: dict) -> list[str]:
    """Params and owner-held state (tensors and steps) of ``got`` that are not ``expected``'s."""
    found = [n for n, t in expected["params"].items() if not torch.equal(got["params"][n], t)]
    assert set(got["owned"]) == set(expected["owned"]) and expected["owned"]
    for name, state in expected["owned"].items():
        for key, value in state.items():
            mine = got["owned"][name][key]
            if not (torch.equal(mine, value) if torch.is_tensor(value) else mine == value):
                found.append(f"{name}.{key}")
    return found


def test_psgd_pro_and_rekls_resume_bitwise_and_reshard_from_dp2_to_dp1_and_dp3(tmp_path) -> None:
    root = str(tmp_path)
    runs = run_on_ranks(_save_and_resume, 2, root)[0]
    for name in NAMES:
        run = runs[name]
        assert _differences(run["resumed"], run["uninterrupted"]) == [], name
        assert _differences(run["saved"], run["uninterrupted"]), name  # the 2 steps moved it
    owners = {}
    for world_size in (3, 1):
        loaded = run_on_ranks(_load, world_size, root)[0]
        for name in NAMES:
            assert _differences(loaded[name], runs[name]["saved"]) == [], (world_size, name)
            owners[world_size, name] = loaded[name]["owners"]
    assert any(len(set(o)) > 1 for (ws, _), o in owners.items() if ws == 3), owners

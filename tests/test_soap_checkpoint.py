"""ShardedSOAP's state in a checkpoint saved at DP=2 loads at DP=1 and DP=3 (an empty shard).

The toy of tests/test_checkpointing.py (a Megatron-FSDP ``ToyMLP``, its matrices trained by
``ShardedSOAP``, its biases by AdamW): two steps and a save (``megatron_muon.save_checkpoint``) at
DP=2 under ``optim``, a load at DP=3 under ``optim_grads_params`` and at DP=1, in fresh processes.
The owner of each matrix changes with the DP size (``soap_plan``); every SOAP state tensor
(moments, Kronecker factors, eigenbases, taken from its owner) and step count, and every param, is
bitwise the saved one. Three launches (save, DP=3, DP=1).
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.checkpoint_toys import DIM, WarmupScheduler, full_snapshot, owner_held_state, train
from tests.soap_reference import EAGER

pytestmark = pytest.mark.multirank


def _build(world_size: int, strategy: str, seed: int = 0):
    from megatron_muon.checkpointing import ensure_optimizer_state, named_optimizer_params
    from megatron_muon.optimizers.soap import ShardedSOAP
    from tests.fsdp_models import ToyMLP, fully_shard_toy

    torch.manual_seed(seed)
    wrapped = fully_shard_toy(ToyMLP(dim=DIM, hidden=48), world_size, strategy)
    named = named_optimizer_params(wrapped)
    matrices = [p for _, p in named if p.ndim == 2]
    others = [p for _, p in named if p.ndim == 1]
    optimizers: list = [
        ShardedSOAP(matrices, lr=1e-2, weight_decay=0.1, shampoo_beta=0.9),
        torch.optim.AdamW(others, lr=1e-2, weight_decay=0.1),
    ]
    ensure_optimizer_state(optimizers)
    return wrapped, optimizers, WarmupScheduler(optimizers)


def _snapshot(wrapped, optimizers) -> dict:
    return {
        "params": full_snapshot(wrapped, optimizers[1:])["params"],  # AdamW: row state
        "soap": owner_held_state(wrapped, optimizers[0]),
    }


def _save(rank: int, world_size: int, path: str) -> dict:
    from megatron_muon.checkpointing import save_checkpoint

    wrapped, optimizers, scheduler = _build(world_size, "optim")
    with EAGER():
        train(wrapped, optimizers, scheduler, rank, world_size, 2, 0, noise=False)
    save_checkpoint(path, wrapped, optimizers, scheduler, iteration=2)
    return _snapshot(wrapped, optimizers)


def _load(rank: int, world_size: int, path: str) -> dict:
    from megatron_muon.checkpointing import load_checkpoint

    wrapped, optimizers, scheduler = _build(world_size, "optim_grads_params", seed=123)
    load_checkpoint(path, wrapped, optimizers, scheduler)
    return {**_snapshot(wrapped, optimizers), "owners": optimizers[0].owner_plan().owners}


def test_soap_state_saved_at_dp2_loads_bitwise_at_dp1_and_dp3(tmp_path) -> None:
    saved = run_on_ranks(_save, 2, str(tmp_path / "soap"))[0]
    assert all(state["step"] == 2 for state in saved["soap"].values()), saved["soap"]
    for world_size in (3, 1):
        loaded = run_on_ranks(_load, world_size, str(tmp_path / "soap"))[0]
        for name, tensor in saved["params"].items():
            assert torch.equal(loaded["params"][name], tensor), (world_size, name)
        assert set(loaded["soap"]) == set(saved["soap"]) and saved["soap"]
        for name, state in saved["soap"].items():
            for key, value in state.items():
                got = loaded["soap"][name][key]
                same = torch.equal(got, value) if torch.is_tensor(value) else got == value
                assert same, (world_size, name, key)

"""Checkpoints of the factory's optimizer (``build_muon_optimizer``: chained Muon + AdamW behind the
FSDP step wrapper) on megatron-core GPTModels under megatron-core's FullyShardedDataParallel: train
k steps, save, train n more; fresh processes load and train n more; params and every optimizer
state tensor (dense Muon, expert Muon over ``expt_dp``, AdamW) are bitwise the uninterrupted run's.
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.checkpoint_toys import assert_bitwise_equal, local_snapshot
from tests.fsdp_models import STRATEGIES

pytestmark = pytest.mark.multirank  # every test here launches ranks


def _gpt(rank, world_size, strategy, moe, path, save, k, n) -> dict:
    """Save after k steps then train n more, or load in fresh processes and train n more.
    Returns this rank's params and optimizer state by name."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_muon import build_muon_optimizer
    from megatron_muon.checkpointing import leaf_optimizers, load_checkpoint, save_checkpoint

    gpt_parity.init_megatron()
    model = gpt_parity.build_gpt(moe=moe)  # MoE: 4 SequentialMLP experts per layer, top-2
    wrapped = gpt_parity.wrap(model, gpt_parity.Run("mcore", strategy), world_size)
    optimizer = build_muon_optimizer(gpt_parity.optimizer_config(), [wrapped])
    # Megatron's scheduler: linear warm-up then cosine decay, weight decay ramp (state to resume).
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=gpt_parity.LR,
        min_lr=0.1 * gpt_parity.LR,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=gpt_parity.WEIGHT_DECAY,
        wd_incr_steps=10,
        wd_incr_style="linear",
    )

    def train(steps: int, first: int) -> None:
        for step in range(first, first + steps):
            tokens, labels = gpt_parity.batch(step, world_size)
            optimizer.zero_grad()
            mine = [t.view(world_size, -1, gpt_parity.SEQ)[rank] for t in (tokens, labels)]
            gpt_parity.loss_of(wrapped, *mine).backward()
            optimizer.step()
            scheduler.step(increment=1)

    if save:
        train(k, 0)
        save_checkpoint(path, [wrapped], optimizer, scheduler, iteration=k)
        first = k
    else:
        first = load_checkpoint(path, [wrapped], optimizer, scheduler).iteration
    train(n, first)
    return local_snapshot(wrapped, leaf_optimizers(optimizer))


@pytest.mark.parametrize(
    "strategy,moe", [("optim", False), ("optim_grads_params", False), ("optim_grads_params", True)]
)
def test_factory_optimizer_on_gpt_resumes_bitwise(strategy, moe, tmp_path):
    path = str(tmp_path / "gpt")
    uninterrupted = run_on_ranks(_gpt, 2, strategy, moe, path, True, 2, 1, timeout=300)
    resumed = run_on_ranks(_gpt, 2, strategy, moe, path, False, 2, 1, timeout=300)
    for rank in range(2):
        expected = uninterrupted[rank]
        kinds = {frozenset(state) for state in expected["state"].values()}
        assert frozenset({"momentum_buffer"}) in kinds and len(kinds) == 2, kinds
        experts = [name for name in expected["state"] if ".experts." in name]
        if moe:
            assert len(experts) == 2 * 2 * gpt_parity.NUM_EXPERTS, (
                experts
            )  # layers x (fc1, fc2) x experts
            for name in experts:
                assert set(expected["state"][name]) == {"momentum_buffer"}, name
        else:
            assert not experts
        assert_bitwise_equal(expected, resumed[rank], f"rank {rank}")
    for name in experts:  # trained: every expert's momentum is non-zero on some rank
        total = sum(r["state"][name]["momentum_buffer"].abs().sum() for r in uninterrupted)
        assert total > 0, name


def _gpt_full_state(rank, world_size, strategy, path, save) -> dict:
    """MoE GPTModel with the factory's optimizer: train 2 steps and save, or load; returns params
    and optimizer state gathered to full tensors."""
    from megatron_muon import build_muon_optimizer
    from megatron_muon.checkpointing import leaf_optimizers, load_checkpoint, save_checkpoint
    from tests.checkpoint_toys import full_snapshot

    gpt_parity.init_megatron()
    model = gpt_parity.build_gpt(moe=True)
    wrapped = gpt_parity.wrap(model, gpt_parity.Run("mcore", strategy), world_size)
    optimizer = build_muon_optimizer(gpt_parity.optimizer_config(), [wrapped])
    if save:
        for step in range(2):
            tokens, labels = gpt_parity.batch(step, world_size)
            optimizer.zero_grad()
            mine = [t.view(world_size, -1, gpt_parity.SEQ)[rank] for t in (tokens, labels)]
            gpt_parity.loss_of(wrapped, *mine).backward()
            optimizer.step()
        save_checkpoint(path, [wrapped], optimizer, iteration=2)
    else:
        load_checkpoint(path, [wrapped], optimizer)
    return full_snapshot(wrapped, leaf_optimizers(optimizer))


def test_factory_moe_checkpoint_saved_at_dp2_loads_at_dp1_with_state_on_the_right_rows(tmp_path):
    path = str(tmp_path / "gpt_moe")
    saved = run_on_ranks(_gpt_full_state, 2, "optim_grads_params", path, True, timeout=300)[0]
    loaded = run_on_ranks(_gpt_full_state, 1, "optim", path, False, timeout=300)[0]
    for name, tensor in saved["params"].items():
        assert torch.equal(loaded["params"][name], tensor), name
    for name, state in saved["state"].items():
        for key, tensor in state.items():
            assert torch.equal(loaded["state"][name][key], tensor), f"{name}.{key}"
    experts = [n for n in saved["state"] if ".experts." in n]
    assert experts and all(saved["state"][n]["momentum_buffer"].abs().sum() > 0 for n in experts)


def _rollback_one(rank: int, world_size: int, strategy: str, path: str) -> tuple:
    """(eval loss when saved, after 2 more steps and an eval, after loading the checkpoint back)."""
    from megatron_muon import build_muon_optimizer
    from megatron_muon.checkpointing import load_checkpoint, save_checkpoint

    def mine(step: int) -> list[torch.Tensor]:
        tokens, labels = gpt_parity.batch(step, world_size)
        return [t.view(world_size, -1, gpt_parity.SEQ)[rank] for t in (tokens, labels)]

    wrapped = gpt_parity.wrap(gpt_parity.build_gpt(), gpt_parity.Run("mcore", strategy), world_size)
    optimizer = build_muon_optimizer(gpt_parity.optimizer_config(), [wrapped])
    losses = []
    for step in range(3):
        optimizer.zero_grad()
        gpt_parity.loss_of(wrapped, *mine(step)).backward()
        optimizer.step()
        if step == 0:
            save_checkpoint(path, [wrapped], optimizer, iteration=1)
        if step in (0, 2):
            with torch.no_grad():
                losses.append(float(gpt_parity.loss_of(wrapped, *mine(99))))
    load_checkpoint(path, [wrapped], optimizer)
    with torch.no_grad():
        losses.append(float(gpt_parity.loss_of(wrapped, *mine(99))))
    return tuple(losses)


def _rollback(rank: int, world_size: int, root: str) -> dict[str, tuple[float, float, float]]:
    gpt_parity.init_megatron()
    return {s: _rollback_one(rank, world_size, s, f"{root}/{s}") for s in STRATEGIES}


def test_loading_into_a_trained_model_makes_the_forward_use_the_loaded_weights(tmp_path):
    # In-process rollback: the main weights are the checkpoint's after the load, and the compute
    # weights the forward reads must be too (Megatron-FSDP keeps gathered copies between forwards).
    for result in run_on_ranks(_rollback, 2, str(tmp_path), timeout=300):
        assert all(trained != saved for saved, trained, _ in result.values())  # training moved it
        wrong = {s: (loaded, saved) for s, (saved, _, loaded) in result.items() if loaded != saved}
        assert not wrong, f"eval loss after the load vs when saved: {wrong}"

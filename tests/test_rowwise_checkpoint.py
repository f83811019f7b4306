"""LaProp, ObliqueSGD and ObliqueAdam resume bitwise from a checkpoint, and one saved at DP=2 loads
at DP=1 and DP=3.

The toy of tests/test_checkpointing.py (a Megatron-FSDP ``ToyMLP``: its matrices trained by the
optimizer on row shards, its biases by AdamW, a warm-up scheduler), for each optimizer in turn:

- DP=2 under ``optim``: two steps, a save (``megatron_muon.save_checkpoint``), two more steps;
  then a fresh model and optimizer (another init seed) load the checkpoint and take the same two
  steps: every param and state value (moments, momentum, Python-int step) equals the
  uninterrupted run's, bit for bit, on each rank;
- the checkpoint loads at DP=3 (an empty row shard) and at DP=1 under ``optim_grads_params``:
  every param and state value, gathered whole, equals the saved one, bit for bit.

Three launches (DP 2, 3, 1), each for the three optimizers.
"""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from megatron_muon.common.options import RowwiseOptimizerT
from megatron_muon.testing import run_on_ranks
from tests.checkpoint_toys import (
    DIM,
    WarmupScheduler,
    assert_bitwise_equal,
    full_snapshot,
    local_snapshot,
    train,
)

pytestmark = pytest.mark.multirank

NAMES = get_args(RowwiseOptimizerT)
KEYWORDS = {
    "laprop": dict(lr=1e-2, weight_decay=0.1),
    "oblique_sgd": dict(lr=0.05, weight_decay=0.1, momentum=0.9),
    "oblique_adam": dict(lr=1e-2, weight_decay=0.1),
}


def _build(name: str, world_size: int, strategy: str, seed: int = 0):
    from megatron_muon.checkpointing import ensure_optimizer_state, named_optimizer_params
    from megatron_muon.fsdp.rowwise_optimizers import ROWWISE_OPTIMIZERS
    from tests.fsdp_models import ToyMLP, fully_shard_toy

    torch.manual_seed(seed)
    wrapped = fully_shard_toy(ToyMLP(dim=DIM, hidden=48), world_size, strategy)
    named = named_optimizer_params(wrapped)
    matrices = [p for _, p in named if p.ndim == 2]
    others = [p for _, p in named if p.ndim == 1]
    optimizers: list = [
        ROWWISE_OPTIMIZERS[name](matrices, **KEYWORDS[name]),
        torch.optim.AdamW(others, lr=1e-2, weight_decay=0.1),
    ]
    ensure_optimizer_state(optimizers)
    return wrapped, optimizers, WarmupScheduler(optimizers)


def _eager() -> None:
    """LaProp's compiled update costs a minute per launch on 2 shared cores (torch.compile
    of ``calculate_laprop_update`` per shape); what is checked here is the state, not the kernel
    (tests/test_sharded_rowwise.py steps the compiled one)."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def _save_and_resume(rank: int, world_size: int, root: str) -> dict:
    from megatron_muon.checkpointing import load_checkpoint, save_checkpoint

    _eager()
    results = {}
    for name in NAMES:
        path = f"{root}/{name}"
        wrapped, optimizers, scheduler = _build(name, world_size, "optim")
        train(wrapped, optimizers, scheduler, rank, world_size, 2, 0, noise=False)
        save_checkpoint(path, wrapped, optimizers, scheduler, iteration=2)
        saved = full_snapshot(wrapped, optimizers)
        train(wrapped, optimizers, scheduler, rank, world_size, 2, 2, noise=False)
        uninterrupted = local_snapshot(wrapped, optimizers)
        wrapped, optimizers, scheduler = _build(name, world_size, "optim", seed=123)
        load_checkpoint(path, wrapped, optimizers, scheduler)
        train(wrapped, optimizers, scheduler, rank, world_size, 2, 2, noise=False)
        resumed = local_snapshot(wrapped, optimizers)
        results[name] = {"saved": saved, "uninterrupted": uninterrupted, "resumed": resumed}
    return results


def _load(rank: int, world_size: int, root: str) -> dict:
    from megatron_muon.checkpointing import load_checkpoint

    _eager()
    results = {}
    for name in NAMES:
        wrapped, optimizers, scheduler = _build(name, world_size, "optim_grads_params", seed=123)
        load_checkpoint(f"{root}/{name}", wrapped, optimizers, scheduler)
        results[name] = full_snapshot(wrapped, optimizers)
    return results


def _assert_same_whole(saved: dict, loaded: dict, where: str) -> None:
    assert_bitwise_equal({**saved, "lrs": []}, {**loaded, "lrs": []}, where)
    assert set(loaded["state"]) == set(saved["state"]), where


def test_each_resumes_bitwise_and_its_dp2_checkpoint_loads_bitwise_at_dp1_and_dp3(
    tmp_path,
) -> None:
    root = str(tmp_path)
    per_rank = run_on_ranks(_save_and_resume, 2, root, timeout=300)
    for rank, results in enumerate(per_rank):
        for name, result in results.items():
            where = f"{name}, rank {rank}, resumed"
            assert_bitwise_equal(result["uninterrupted"], result["resumed"], where)
    saved = per_rank[0]
    for name in NAMES:
        states = saved[name]["saved"]["state"].values()
        steps = [s["step"] for s in states if isinstance(s.get("step"), int)]  # not AdamW's
        assert steps == ([] if name == "oblique_sgd" else [2, 2]), (name, steps)
    for world_size in (3, 1):
        loaded = run_on_ranks(_load, world_size, root, timeout=300)[0]
        if world_size == 3:  # a rank holds no rows of a matrix there
            ranges = [r for name in NAMES for rs in loaded[name]["layouts"].values() for r in rs]
            assert any(start == stop for start, stop in ranges), ranges
        for name in NAMES:
            _assert_same_whole(saved[name]["saved"], loaded[name], f"{name} at DP={world_size}")

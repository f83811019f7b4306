"""ShardedAdaptiveMuon's state in a checkpoint saved at DP=2 loads at DP=1 and DP=3 (empty shards).

The toy of tests/test_checkpointing.py (a Megatron-FSDP ``ToyMLP``, its matrices trained by
``ShardedAdaptiveMuon``, its biases by AdamW) for each second-moment method: two steps and a save
(``megatron_muon.save_checkpoint``) at DP=2 under ``optim``, loads at DP=1 under ``no_shard``
and at DP=3 under ``optim_grads_params`` in fresh processes. Params, momentum and second moments
(row-sharded for adamuon, replicated for normuon and namo) gathered to full tensors are bitwise
the saved ones; the next step equals the never-resharded run's within ``RESHARD_TOLERANCE``
(1e-6: the gradients' all-reduce order differs with DP size). Three launches for the three
methods.
"""

from __future__ import annotations

import pytest

from megatron_muon.testing import run_on_ranks
from tests.checkpoint_toys import assert_resharded, build, full_snapshot, train

pytestmark = pytest.mark.multirank

METHODS = ("adamuon", "normuon", "namo")


def _save(rank: int, world_size: int, path: str) -> dict:
    from megatron_muon.checkpointing import save_checkpoint

    results = {}
    for method in METHODS:
        wrapped, optimizers, scheduler = build(world_size, "optim", adaptive=method)
        train(wrapped, optimizers, scheduler, rank, world_size, 2, 0, noise=False)
        save_checkpoint(f"{path}/{method}", wrapped, optimizers, scheduler, iteration=2)
        saved = full_snapshot(wrapped, optimizers)
        train(wrapped, optimizers, scheduler, rank, world_size, 1, 2, noise=False)
        results[method] = {"saved": saved, "next": full_snapshot(wrapped, optimizers)}
    return results


def _load(rank: int, world_size: int, path: str, strategy: str) -> dict:
    from megatron_muon.checkpointing import load_checkpoint

    results = {}
    for method in METHODS:
        wrapped, optimizers, scheduler = build(world_size, strategy, seed=123, adaptive=method)
        loaded = load_checkpoint(f"{path}/{method}", wrapped, optimizers, scheduler)
        after_load = full_snapshot(wrapped, optimizers)
        train(wrapped, optimizers, scheduler, rank, world_size, 1, loaded.iteration, noise=False)
        results[method] = {
            "loaded": after_load,
            "next": full_snapshot(wrapped, optimizers),
            "rng_restored": loaded.rng_restored,
        }
    return results


def test_adaptive_muon_state_saved_at_dp2_loads_bitwise_at_dp1_and_dp3(tmp_path) -> None:
    saved = run_on_ranks(_save, 2, str(tmp_path))[0]
    for method in METHODS:
        keys = {k for state in saved[method]["saved"]["state"].values() for k in state}
        assert "moment2_buffer" in keys, (method, keys)
    for world_size, strategy in ((1, "no_shard"), (3, "optim_grads_params")):
        loaded = run_on_ranks(_load, world_size, str(tmp_path), strategy)
        for method in METHODS:
            assert_resharded(saved[method], [result[method] for result in loaded])

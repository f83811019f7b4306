"""Momentum offload (``offload_momentum=True``) through the factory (``build_muon_optimizer``) on
a tiny megatron-core GPT under Megatron-FSDP (``tests/factory_gpt_runs.py``): bitwise equal to the
run without offload over several steps, and after ``save_checkpoint`` / ``load_checkpoint`` into a
fresh model and optimizer the resumed run is still bitwise equal to the uninterrupted one.
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.factory_gpt_runs import NUM_STEPS, _build, _rows, _step


def _offload_and_resume(rank: int, world_size: int, path: str) -> dict:
    from megatron_muon.checkpointing import load_checkpoint, save_checkpoint

    gpt_parity.init_megatron()
    total = 2 * NUM_STEPS
    wrapped, named, optimizer = _build(world_size, {})
    for step in range(total):
        _step(wrapped, optimizer, step, rank, world_size)
    plain = _rows(named)

    wrapped, named, optimizer = _build(world_size, {"offload_momentum": True})
    muon = optimizer.chained_optimizers[0].optimizer
    for step in range(NUM_STEPS):
        _step(wrapped, optimizer, step, rank, world_size)
    momentum_device = {str(s["momentum_buffer"].device) for s in muon.state.values()}
    save_checkpoint(path, [wrapped], optimizer, iteration=NUM_STEPS)
    for step in range(NUM_STEPS, total):
        _step(wrapped, optimizer, step, rank, world_size)
    offloaded = _rows(named)

    wrapped, named, optimizer = _build(world_size, {"offload_momentum": True})
    first = load_checkpoint(path, [wrapped], optimizer).iteration
    for step in range(first, total):
        _step(wrapped, optimizer, step, rank, world_size)
    resumed = _rows(named)
    return {
        "plain": plain,
        "offloaded": offloaded,
        "resumed": resumed,
        "offload": muon.fsdp_config.offload_momentum,
        "momentum_device": momentum_device,
    }


@pytest.mark.multirank
def test_momentum_offload_is_bitwise_equal_to_no_offload_and_resumes_bitwise(tmp_path):
    results = run_on_ranks(_offload_and_resume, 2, str(tmp_path / "ckpt"), timeout=300)
    for rank, result in enumerate(results):
        assert result["offload"] is True
        assert result["momentum_device"] == {"cpu"}
        for name, (start, rows) in result["plain"].items():
            assert torch.equal(result["offloaded"][name][1], rows), f"rank {rank} {name} offload"
            assert torch.equal(result["resumed"][name][1], rows), f"rank {rank} {name} resume"
            assert result["resumed"][name][0] == start

"""examples/custom_trainer.py: the factory in a user's own loop trains on 2 ranks."""

from __future__ import annotations

import pytest

from megatron_muon.testing import run_on_ranks

pytestmark = pytest.mark.multirank  # every test here launches ranks


def _train(rank: int, world_size: int) -> list[float]:
    from examples.custom_trainer import train

    return train(steps=8, seq_length=32, micro_batch=4, lr=0.01)


def test_custom_trainer_example_trains_on_two_ranks_and_the_loss_falls():
    losses = run_on_ranks(_train, 2, timeout=300)
    assert losses[0] == losses[1]  # the data-parallel mean loss, identical on both ranks
    first, last = losses[0][0], losses[0][-1]
    assert last < first - 0.5, losses[0]

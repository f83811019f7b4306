"""The ideal ratio's forward+backward FLOP count matches what torch counts on the real GPTModel."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.config import QUICK
from benchmarks.ideal_ratio import (
    counted_forward_backward_flops,
    forward_backward_flops,
    ideal_ratio,
)
from benchmarks.launcher import run_ranks


@pytest.mark.multirank
def test_forward_backward_flops_match_torch_flop_counter_on_gpt_model():
    # One rank builds the bench's Megatron-FSDP GPTModel and counts one forward+backward's matmul
    # FLOPs with torch's FlopCounterMode; the formula must give the same integer (matmul FLOPs are
    # exact counts, no tolerance).
    size = dataclasses.replace(QUICK.gpt, micro_batch=3)
    (counted,) = run_ranks(counted_forward_backward_flops, 1, "cpu", size)
    assert forward_backward_flops(size) == counted


def test_ideal_ratio_falls_towards_one_as_tokens_per_step_grow():
    ratios = [ideal_ratio(1e9, dataclasses.replace(QUICK.gpt, micro_batch=mb)) for mb in (1, 4, 16)]
    assert ratios[0] > ratios[1] > ratios[2] > 1.0
    # NS FLOPs are fixed, fwd+bwd FLOPs linear in tokens: the excess over 1 scales as 1/tokens.
    assert (ratios[0] - 1) == pytest.approx(4 * (ratios[1] - 1), rel=1e-12)

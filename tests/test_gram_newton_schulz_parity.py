"""Gram Newton-Schulz (``ns_method="gram"``, fp32 "highest") through the factory
(``build_muon_optimizer``) on a tiny megatron-core GPT under Megatron-FSDP
(``tests/factory_gpt_runs.py``): the 2-rank run matches the 1-rank run with the same method to
within the gradient reduction-order deviation that standard NS shows between its own 2-rank and
1-rank runs (amplified ~2.5x by Gram NS; numbers in the test), and differs from standard NS (it
really ran).
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.factory_gpt_runs import NUM_STEPS, _assemble, _build, _rows, _step

GRAM_TOLERANCE = 1e-6  # fp32 "highest": absolute slack on Gram NS's DP=2 vs DP=1 deviation


def _final_rows(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    gpt_parity.init_megatron()
    out = []
    for fsdp_kwargs in runs:
        wrapped, named, optimizer = _build(world_size, fsdp_kwargs)
        after_step = []
        for step in range(NUM_STEPS):
            _step(wrapped, optimizer, step, rank, world_size)
            after_step.append(_rows(named))
        muon = optimizer.chained_optimizers[0].optimizer
        out.append(
            {
                "after_step": after_step,
                "rows": after_step[-1],
                "ns_method": muon.ns_config.ns_method,
                "muon": [
                    gpt_parity._strip(r.name) for r in optimizer.routing if r.optimizer == "muon"
                ],
            }
        )
    return out


@pytest.mark.multirank
def test_gram_newton_schulz_on_two_ranks_matches_one_rank_as_closely_as_standard_ns_does():
    runs = [{"ns_method": "gram"}, {"ns_method": "standard"}]
    two = run_on_ranks(_final_rows, 2, runs, timeout=300)
    one = run_on_ranks(_final_rows, 1, runs, timeout=300)
    assert [r["ns_method"] for r in one[0]] == ["gram", "standard"]
    assert all(r[0]["ns_method"] == "gram" for r in two)
    muon_names = one[0][0]["muon"]
    assert len(muon_names) == 8, muon_names  # linear_qkv, linear_proj, fc1, fc2 of 2 layers
    by_step, differs = [], set()
    for step in range(NUM_STEPS):
        two_full = [_assemble([r[i]["after_step"][step] for r in two]) for i in range(2)]
        worst = {"gram": 0.0, "standard": 0.0}
        for name in muon_names:
            for index, method in enumerate(("gram", "standard")):
                expected = one[0][index]["after_step"][step][name][1]
                difference = (two_full[index][name] - expected).norm()
                worst[method] = max(worst[method], float(difference / expected.norm()))
            # linear_proj (64 x 64) is square: Gram NS falls back to standard NS there.
            if not torch.equal(two_full[0][name], two_full[1][name]):
                differs.add(name)
        by_step.append(worst)
    assert any("linear_fc1" in name for name in differs), f"gram == standard except {differs}"
    print(f"\nMuon params, DP=2 vs DP=1 largest relative error after each step: {by_step}")
    # DP=2 and DP=1 differ before NS: the 2-rank averaged gradient's fp32 reduction order. NS
    # amplifies it (the momentum's small singular directions), standard NS to ~4e-6 in the weights
    # after one step on this model, Gram NS ~2.5x more (X X^T squares the singular values);
    # later steps compound it through AdamW's embeddings. Measured: gram 8.9e-6 / 1.2e-5 / 1.3e-5,
    # standard 3.8e-6 / 4.7e-6 / 4.9e-6 after steps 1-3. So 1e-6 is out of reach through the whole
    # model; what this checks is that Gram NS on shards adds no error beyond that amplification:
    # the standard method's own DP=2 vs DP=1 deviation in the same run is the floor (factor 4:
    # Gram's 2.5x amplification, measured, with room for the reduction order of another CPU).
    for worst in by_step:
        assert worst["gram"] <= 4 * worst["standard"] + GRAM_TOLERANCE, by_step

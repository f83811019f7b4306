"""build_muon_optimizer with ``optimizer="adaptive_muon"`` on a real Megatron-FSDP GPTModel.

One launch (2 gloo ranks) trains the tiny GPTModel of tests/test_factory.py under megatron-core's
``FullyShardedDataParallel`` for 5 steps with each second-moment method, one sharding strategy and
loop flavour each, next to a single-process fp32 reference: megatron-core's
``TensorParallelAdaptiveMuon`` with its crash fixed (``integrations.adaptive_muon_fix``; QKV split
as in the sharded run) + AdamW on full tensors (``tests/gpt_parity.py``). Params within twice the
reduction-order floor measured in the same launch, losses and grad norms to 1e-5 (the rule of
tests/test_factory.py). adamuon's update divides each element of the Newton-Schulz result by its
own running magnitude, so an element's relative rounding error becomes an absolute error of the
update: ours and the reordered reference both drift from the reference by ~3e-3 in params after 5
steps (measured on linear_qkv: 2.96e-3 and 2.79e-3), ours by 1.6e-5 in grad norm after one step,
so its losses and grad norms are held to ``FLOOR_FACTOR`` times the same-launch drift of the
reordered reference instead.
"""

from __future__ import annotations

import pytest

from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.factory_gpt_runs import assert_matches_reference, by_run, train_runs
from tests.gpt_parity import Run

RUNS = [
    Run("mcore", "optim_grads_params", moment2_method="normuon"),
    Run("mcore", "optim", num_microbatches=2, megatron_loop=True, moment2_method="namo"),
    Run("mcore", "no_shard", mode="gather", moment2_method="adamuon", lr=1e-3),
]


@pytest.fixture(scope="module")
def results() -> dict[Run, list[dict]]:
    return by_run(run_on_ranks(train_runs, 2, RUNS, timeout=600), RUNS)


@pytest.mark.multirank
@pytest.mark.parametrize("run", RUNS, ids=lambda run: f"{run.moment2_method}-{run.strategy}")
def test_adaptive_muon_gpt_matches_the_unsharded_stock_optimizer(results, run: Run) -> None:
    per_rank = results[run]
    assert any(
        f"AdaptiveMuon({run.moment2_method})[dense]" in line for line in per_rank[0]["summary"]
    )
    if run.moment2_method != "adamuon":
        assert_matches_reference(per_rank)
        return
    errors = gpt_parity.assert_within_floor(per_rank, per_rank[0]["floor"])
    worst = max(errors, key=errors.get)
    floor = per_rank[0]["floor"][worst]
    print(f"\nadamuon: largest deviation {worst} {errors[worst]:.2e}, its floor {floor:.2e}")
    for result in per_rank:
        for step, stats in enumerate(result["stats"]):
            for key in ("loss", "grad_norm"):
                expected = stats[f"reference_{key}"]
                drift = abs(stats[f"reordered_{key}"] - expected)
                bound = gpt_parity.FLOOR_FACTOR * drift + 1e-5 * abs(expected)
                assert abs(stats[key] - expected) <= bound, (step, key, stats)

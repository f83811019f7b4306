"""Megatron-Bridge's ``pretrain`` with ``MuonFsdpOptimizerConfig``: exact across DP, resumable.

Every launch is Bridge's own training loop on CPU/gloo ranks (``tests/bridge/bridge_driver.py``
runs ``examples/bridge_pretrain_gpt.py``'s tiny GPT, 6 iterations), reading each iteration's
loss and grad norm at full precision. These tests need Megatron-Bridge: ``make test-bridge`` runs
them in ``.venv-bridge`` (``scripts/setup_bridge_venv.sh``); elsewhere they are skipped.

Tolerances: Newton-Schulz runs with fp32 "highest" matmuls on both sides, so DP=2 differs from
DP=1 only by reduction order (the gradient reduce over 2 ranks, the loss averaged over 2 x 2
micro-batches instead of 4): relative 1e-5, measured <= 2.5e-6. A resumed run, and Adam with and
without the integration, compute the same operations in the same order: bitwise.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.torchrun import MegatronRun, run_megatron

DRIVER = Path(__file__).with_name("bridge_driver.py")
STEP_MARKER = "BRIDGE_STEP "
OPTIMIZER_MARKER = "BRIDGE_OPTIMIZER "
ITERS = 6
SAVED_AT = 3
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DP_RTOL = 1e-5
OURS = "MegatronCheckpointedOptimizer"
# Below every head's max logit of the tiny GPT at its first steps (0.06 to 0.14): heads clip.
QK_CLIP_THRESHOLD = 0.05

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron.bridge") is None,
        reason="Megatron-Bridge is not installed here: `make test-bridge` runs these tests in "
        ".venv-bridge (scripts/setup_bridge_venv.sh)",
    ),
]

_CHECKPOINTS = Path(tempfile.mkdtemp(prefix="mm_bridge_ckpt_"))


@functools.cache
def _launch(spec_json: str, nproc: int) -> MegatronRun:
    return run_megatron(
        [spec_json], nproc=nproc, timeout=240, entry=[str(DRIVER)], entry_prints_done_marker=True
    )


def bridge_run(nproc: int = 2, **spec: Any) -> MegatronRun:
    """One launch (cached: several tests read the same run) of ``spec`` on ``nproc`` ranks."""
    spec = {"optimizer": "muon", "train_iters": ITERS, **spec}
    return _launch(json.dumps(spec, sort_keys=True), nproc)


def steps(run: MegatronRun) -> list[dict[str, float]]:
    """Rank 0's ``BRIDGE_STEP`` objects, in iteration order."""
    lines = run.rank_outputs[0].splitlines()
    found = [json.loads(line[len(STEP_MARKER) :]) for line in lines if line.startswith(STEP_MARKER)]
    return sorted(found, key=lambda step: step["iteration"])


def optimizer_class(run: MegatronRun) -> str:
    lines = run.rank_outputs[0].splitlines()
    return next(
        line[len(OPTIMIZER_MARKER) :] for line in lines if line.startswith(OPTIMIZER_MARKER)
    )


def uninterrupted_run() -> MegatronRun:
    """DP=2, optim_grads_params, saving at iteration 3 on its way to 6."""
    return bridge_run(save=str(_CHECKPOINTS / "muon"), save_interval=SAVED_AT)


def assert_close_steps(actual: list[dict[str, float]], expected: list[dict[str, float]]) -> None:
    """Every iteration's loss and grad norm within ``DP_RTOL``; prints the worst (``-s``)."""
    assert [s["iteration"] for s in actual] == [s["iteration"] for s in expected]
    worst = 0.0
    for got, want in zip(actual, expected, strict=True):
        for key in ("lm loss", "grad norm"):
            assert math.isclose(got[key], want[key], rel_tol=DP_RTOL), (got, want)
            worst = max(worst, abs(got[key] - want[key]) / abs(want[key]))
    print(f"worst relative difference {worst:.2e}; steps {json.dumps(actual)}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_muon_at_dp2_equals_dp1_under_each_sharding_strategy(strategy: str) -> None:
    reference = steps(bridge_run(nproc=1))
    run = (
        uninterrupted_run()
        if strategy == "optim_grads_params"
        else bridge_run(data_parallel_sharding_strategy=strategy)
    )
    assert optimizer_class(run) == OURS
    assert len(reference) == ITERS
    assert_close_steps(steps(run), reference)
    losses = [s["lm loss"] for s in steps(run)]
    assert losses[-1] < losses[0] - 0.5, losses


def test_resume_from_fsdp_dtensor_checkpoint_continues_the_run_bitwise() -> None:
    uninterrupted = steps(uninterrupted_run())
    resumed = steps(bridge_run(load=str(_CHECKPOINTS / "muon"), ckpt_step=SAVED_AT))
    assert [s["iteration"] for s in resumed] == list(range(SAVED_AT, ITERS))
    assert resumed == uninterrupted[SAVED_AT:]


def test_dist_muon_recipe_config_trains_megatron_muon() -> None:
    """Bridge's Muon recipes make ``optimizer="dist_muon"`` (``distributed_muon_with_cosine_
    annealing``); through ``muon_fsdp_with_cosine_annealing`` it is megatron-muon's Muon, the same
    updates as ``"muon"`` with the same settings."""
    run = bridge_run(recipe=True, optimizer="dist_muon")
    assert optimizer_class(run) == OURS
    assert "megatron-muon Muon[dense]" in run.rank_outputs[0]
    assert_close_steps(steps(run), steps(uninterrupted_run()))


def test_adam_logs_the_same_lines_with_and_without_the_integration() -> None:
    stock = bridge_run(optimizer="adam", integration=False)
    ours = bridge_run(optimizer="adam", save=str(_CHECKPOINTS / "adam"), save_interval=ITERS)
    assert "BRIDGE_INTEGRATION_IMPORTED false" in stock.rank_outputs[0]
    assert "BRIDGE_INTEGRATION_IMPORTED true" in ours.rank_outputs[0]
    assert len(steps(stock)) == ITERS
    assert steps(ours) == steps(stock)
    # Stock Bridge + Adam hangs in this save at DP=2 (a rank without rows of a param has no lazy
    # Adam state); with the integration every param's state exists on every rank before it.
    assert (_CHECKPOINTS / "adam" / f"iter_{ITERS:07d}").is_dir()


def test_model_qk_clip_runs_megatron_muon_clip_and_skips_bridges_clip_qk() -> None:
    """The model's ``qk_clip`` (Bridge's MuonClip switch) with our Muon: megatron-muon's ``QKClip``
    clips the main weights' row shards after each step; Bridge's ``clip_qk`` (compute weights)
    must not run on top of it."""
    run = bridge_run(model={"qk_clip": True, "qk_clip_threshold": QK_CLIP_THRESHOLD})
    output = run.rank_outputs[0]
    assert f"megatron-muon QK-clip: threshold {QK_CLIP_THRESHOLD} on 2 attention layers" in output
    clipped = [int(n) for n in re.findall(r"^QK-clip: (\d+) heads clipped", output, re.MULTILINE)]
    assert len(clipped) == ITERS and all(clipped), clipped
    assert "BRIDGE_CLIP_QK_CALLS 0" in output
    losses = [s["lm loss"] for s in steps(run)]
    assert losses[-1] < losses[0] - 0.5, losses

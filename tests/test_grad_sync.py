"""The custom-trainer loop of the README gives the unsharded reference's gradients and weights under
every Megatron-FSDP configuration, with gradients reduced exactly once.

One launch of 2 gloo ranks trains the tiny GPTModel for 3 steps per configuration next to the
single-process fp32 reference (``tests/gpt_parity.py``): the plain loop ``zero_grad -> backward ->
step`` (no ``no_sync()`` anywhere) under megatron-core's ``FullyShardedDataParallel`` and
``megatron_fsdp.fully_shard_model``, ``overlap_grad_reduce`` on and off, all four strategies; and
gradient accumulation over 2 micro-batches, Megatron's way (``no_sync()`` around the first) and
plainly. A gradient reduced zero times or twice shows in the grad norm (before the wrapper read
the sync state: 1.665 / 1.700 instead of 1.162 for megatron-core's wrapper under no_shard / optim
with overlap, 0.64 for ``fully_shard_model`` under optim without overlap) and in the weights
(no_shard replicas drifted apart). Tolerances as in ``test_factory.py`` (fp32, "highest" matmuls):
params within ``gpt_parity.FLOOR_FACTOR`` of the reordered reference's floor, losses and grad norms
**floor-judged** against it (tests/run_comparison.py).
"""

from __future__ import annotations

import pytest

from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.fsdp_models import STRATEGIES
from tests.gpt_parity import Run
from tests.run_comparison import assert_steps_within_floor

pytestmark = pytest.mark.multirank  # every test here launches ranks

NUM_STEPS = 3


def _plain_loop_run(wrapper: str, overlap: bool, strategy: str) -> Run:
    # fully_shard_model's default sync_model_each_microbatch=True with overlap off under optim
    # reduces twice inside Megatron-FSDP's own backward: refused (tested below), so that cell runs
    # with sync_model_each_microbatch=False.
    refused = wrapper == "fully_shard" and not overlap and strategy == "optim"
    return Run(
        wrapper,
        strategy,
        overlap_grad_reduce=overlap,
        sync_model_each_microbatch=False if refused else None,
    )


PLAIN_LOOP_RUNS = [
    _plain_loop_run(wrapper, overlap, strategy)
    for wrapper in ("mcore", "fully_shard")
    for overlap in (True, False)
    for strategy in STRATEGIES
]
ACCUMULATION_RUNS = [
    # The last backward reduces (after no_sync); finish_grad_sync must not reduce again.
    Run("mcore", "optim", num_microbatches=2, overlap_grad_reduce=False),
    # No backward reduces; with overlap on, finish_grad_sync alone would only wait.
    Run("mcore", "no_shard", num_microbatches=2, accumulate="plain"),
    Run("fully_shard", "optim", num_microbatches=2, accumulate="plain", overlap_grad_reduce=False),
]
RUNS = PLAIN_LOOP_RUNS + ACCUMULATION_RUNS


def _refused_settings(world_size: int) -> str:
    from megatron_muon import build_muon_optimizer

    run = Run("fully_shard", "optim", overlap_grad_reduce=False, sync_model_each_microbatch=True)
    wrapped = gpt_parity.wrap(gpt_parity.build_gpt(), run, world_size)
    with pytest.raises(ValueError) as error:
        build_muon_optimizer(gpt_parity.optimizer_config(), [wrapped])
    return str(error.value)


def _unsynced_step_in_megatron_mode(rank: int, world_size: int) -> str:
    from megatron_muon import build_muon_optimizer

    run = Run("mcore", "optim")
    wrapped = gpt_parity.wrap(gpt_parity.build_gpt(), run, world_size)
    optimizer = build_muon_optimizer(
        gpt_parity.optimizer_config(), [wrapped], grads_already_synced=True
    )
    tokens, labels = gpt_parity.batch(0, world_size)
    mine = tokens.view(world_size, -1, gpt_parity.SEQ)[rank]
    gpt_parity.loss_of(wrapped, mine, labels.view(world_size, -1, gpt_parity.SEQ)[rank]).backward()
    with pytest.raises(RuntimeError) as error:
        optimizer.step()
    return str(error.value)


def _train_all(rank: int, world_size: int) -> dict:
    gpt_parity.init_megatron()
    return {
        "runs": [gpt_parity.train(run, rank, world_size, NUM_STEPS) for run in RUNS],
        "refused": _refused_settings(world_size),
        "unsynced": _unsynced_step_in_megatron_mode(rank, world_size),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_on_ranks(_train_all, 2, timeout=600)


def _per_rank(results: list[dict], run: Run) -> list[dict]:
    return [result["runs"][RUNS.index(run)] for result in results]


def _assert_matches_reference(per_rank: list[dict]) -> None:
    for rank, result in enumerate(per_rank):
        # Floor-judged (tests/run_comparison.py).
        assert_steps_within_floor(f"rank {rank}", result["stats"])
    # Whole-param relative error over the ranks' rows; no_shard replicas are each compared.
    gpt_parity.assert_within_floor(per_rank, per_rank[0]["floor"])


@pytest.mark.parametrize(
    "run",
    PLAIN_LOOP_RUNS,
    ids=lambda r: f"{r.wrapper}-overlap{int(r.overlap_grad_reduce)}-{r.strategy}",
)
def test_plain_custom_loop_matches_the_unsharded_reference(results, run):
    _assert_matches_reference(_per_rank(results, run))


@pytest.mark.parametrize(
    "run", ACCUMULATION_RUNS, ids=lambda r: f"{r.wrapper}-{r.strategy}-{r.accumulate}"
)
def test_gradient_accumulation_reduces_the_summed_gradient_once(results, run):
    _assert_matches_reference(_per_rank(results, run))


def test_a_megatron_fsdp_that_reduces_twice_in_its_own_backward_is_refused(results):
    for result in results:
        assert "sync_model_each_microbatch=True" in result["refused"]
        assert "overlap_grad_reduce=False under the 'optim' strategy" in result["refused"]


def test_step_refuses_unreduced_gradients_when_told_the_loop_synced_them(results):
    for result in results:
        assert result["unsynced"].startswith("grads_already_synced=True, but 1 backward pass(es)")

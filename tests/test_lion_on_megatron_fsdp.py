"""``--optimizer lion`` on Megatron-FSDP: megatron-core's Lion on each rank's row shards as is.

megatron-core 0.19.2 routes ``--optimizer lion`` as Muon: Lion for the hidden matrices, Adam for
embeddings, output layer, biases and norms (its default emerging-optimizer entry). Lion's update is
elementwise (decoupled decay, the sign of an interpolation of momentum and grad, the momentum EMA),
so it needs no whole matrix: megatron-muon's factory builds megatron-core's own ``Lion`` (its
standard path, ``lion_beta1``/``lion_beta2``) over the matrices' Megatron-FSDP row shards as they
are, and AdamW for the rest; a rank holding no rows of a param keeps its state all the same.
Checked here:

- Megatron-LM's loop with ``install()``, ``--use-megatron-fsdp --ckpt-format fsdp_dtensor``, every
  sharding strategy at DP=2 against **one rank running megatron-core's own Lion without
  Megatron-FSDP** (its DDP, same flags; RoPE, so that no learned position embedding is routed
  differently: megatron-muon gives it to AdamW, megatron-core to the matrix optimizer, as for
  Muon), **floor-judged** (tests/run_comparison.py: the gradients are reduced in another order,
  which Lion's sign step may amplify): 6 iterations' printed losses and full-precision grad
  norms, each within ``FLOOR_FACTOR`` times what the stock run with every weight one ulp up
  (one more launch) grew to by then; the optim_grads_params run saves at 4, and a run resumed
  from it in fresh processes prints the same losses and grad norms and saves the same tensors,
  bitwise; the same checkpoint loaded with ``--optimizer soap`` is refused on every rank naming
  both optimizers, before any collective.
  Stock megatron-core 0.19.2 builds ``--optimizer lion`` with Adam's betas; ``install()`` makes it
  read ``--lion-beta1/2`` (``integrations.stock_lion``), so both sides use Lion's betas.
- A custom trainer: the factory builds Lion from ``OptimizerConfig(optimizer="lion")`` for the
  tiny GPTModel under megatron-core's ``FullyShardedDataParallel``, every strategy, DP=2: params
  after 5 steps within ``gpt_parity.FLOOR_FACTOR`` of the reduction-order floor of the unsharded
  emerging-optimizers ``Lion`` + torch ``AdamW`` (measured in the same launch), losses and grad
  norms floor-judged against the same reference's (tests/run_comparison.py); some Lion params
  have no rows on one rank (empty shards).
  The same for the MoE GPT (4 experts, their rows over ``expt_dp``; one Lion steps dense and
  expert shards alike), under optim_grads_params, in the same launch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.fsdp_models import STRATEGIES
from tests.gpt_parity import Run
from tests.megatron_lm_logs import assert_loss_falls
from tests.run_comparison import (
    assert_runs_within_floor,
    assert_steps_within_floor,
    floor_run,
)
from tests.torchrun import MegatronRun, TorchrunFailure, run_megatron

pytestmark = pytest.mark.timeout(900)

NUM_ITERS = 6
SAVE_AT = 4
LION_FLAGS = [
    *("--optimizer lion --lr 0.003 --lion-beta1 0.9 --lion-beta2 0.97").split(),
    *("--position-embedding-type rope").split(),
    *("--train-iters", str(NUM_ITERS)),
]
CUSTOM_STEPS = 5


def _strategy(name: str) -> list[str]:
    return ["--data-parallel-sharding-strategy", name]


# --------------------------------------------------------------------------------------------------
# Megatron-LM's loop
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lion_ckpt")


@pytest.fixture(scope="module")
def stock_lion() -> MegatronRun:
    """One rank, megatron-core's own Lion without Megatron-FSDP (DDP, torch_dist format)."""
    return run_megatron(LION_FLAGS, nproc=1, megatron_fsdp=False)


@pytest.fixture(scope="module")
def stock_lion_floor() -> MegatronRun:
    """``stock_lion`` with every weight one ulp up: its floor (tests/run_comparison.py)."""
    return floor_run(LION_FLAGS, nproc=1, megatron_fsdp=False)


_DP2_RUNS: dict[str, MegatronRun] = {}


def lion_dp2(strategy: str, checkpoint_root: Path) -> MegatronRun:
    """The DP=2 Lion run of ``strategy`` (optim_grads_params also saves at 4 and at the end)."""
    if strategy not in _DP2_RUNS:
        extra = []
        if strategy == "optim_grads_params":
            extra = ["--save", str(checkpoint_root / "uninterrupted"), "--save-interval", "4"]
        _DP2_RUNS[strategy] = run_megatron([*LION_FLAGS, *_strategy(strategy), *extra], nproc=2)
    return _DP2_RUNS[strategy]


@pytest.mark.multirank
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lion_in_megatron_lms_loop_equals_stock_lion_on_one_rank_for_each_strategy(
    strategy: str, stock_lion: MegatronRun, stock_lion_floor: MegatronRun, checkpoint_root: Path
) -> None:
    """Floor-judged (module docstring)."""
    run = lion_dp2(strategy, checkpoint_root)
    assert run.optimizers[0]["class"] == "MegatronCheckpointedOptimizer"
    summary = run.optimizers[0]["summary"]
    assert [line.split(":")[0] for line in summary] == ["megatron-muon Lion", "megatron-muon AdamW"]
    assert f"strategy {strategy}" in summary[0]
    losses = run.series("lm loss")
    print(f"\n{strategy} DP=2 lm loss: {losses}\n stock DP=1 lm loss: {stock_lion.series()}")
    assert_loss_falls(losses)
    label = f"lion {strategy} DP=2 vs stock DP=1"
    assert_runs_within_floor(label, run, stock_lion, stock_lion_floor)


def _load_checkpoint(directory: Path) -> dict[str, Any]:
    """Every tensor of an ``fsdp_dtensor`` (DCP) checkpoint, by flattened key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = directory.parent / f"{directory.name}.pt"
    dcp_to_torch_save(str(directory), str(target))
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node

    walk(torch.load(target, weights_only=False), "")
    return flat


@pytest.mark.multirank
def test_lion_resumed_from_its_fsdp_dtensor_checkpoint_is_bit_identical(
    checkpoint_root: Path,
) -> None:
    uninterrupted = lion_dp2("optim_grads_params", checkpoint_root)
    layouts = uninterrupted.layouts
    empty_on_some_rank = [
        name
        for name, (rows, total) in layouts[0].items()
        if total > 0 and 0 in (rows, layouts[1][name][0])
    ]
    assert empty_on_some_rank, layouts
    resumed = run_megatron(
        [
            *LION_FLAGS,
            *_strategy("optim_grads_params"),
            *("--load", str(checkpoint_root / "uninterrupted"), "--ckpt-step", str(SAVE_AT)),
            "--no-load-rng",  # the CPU stand-in's CUDA RNG state is a dummy
            *("--save", str(checkpoint_root / "resumed"), "--save-interval", "4"),
        ],
        nproc=2,
    )
    assert sorted(resumed.iterations) == list(range(SAVE_AT + 1, NUM_ITERS + 1))
    # The full-precision grad norms (the driver's record), bitwise.
    assert resumed.grad_norms == uninterrupted.grad_norms[SAVE_AT:NUM_ITERS]
    # The first line after a start prints its own loss; the next the mean of two (loop_tests).
    first = SAVE_AT + 1
    assert resumed.iterations[first]["lm loss"] == uninterrupted.iterations[first]["lm loss"]

    final = f"iter_{NUM_ITERS:07d}"
    expected_state = _load_checkpoint(checkpoint_root / "uninterrupted" / final)
    got = _load_checkpoint(checkpoint_root / "resumed" / final)
    tensors = sorted(k for k, v in expected_state.items() if torch.is_tensor(v))
    assert sorted(k for k, v in got.items() if torch.is_tensor(v)) == tensors
    momenta = [k for k in tensors if k.endswith("exp_avg")]
    assert momenta
    for name in empty_on_some_rank:  # state exists for params a rank holds no rows of
        short = name.split("module.module.", 1)[-1]
        assert any(short in k for k in momenta), (short, momenta)
    differing = [k for k in tensors if not torch.equal(got[k], expected_state[k])]
    assert not differing, f"resumed run differs from the uninterrupted one in {differing}"


@pytest.mark.multirank
def test_a_lion_checkpoint_loaded_into_a_soap_run_is_refused_naming_both(
    checkpoint_root: Path,
) -> None:
    # Megatron-LM's loop with install() alone (not the pretrain entry point); without the check
    # Megatron's partial load waits in collectives for state the checkpoint does not hold
    # (measured for a Muon checkpoint loaded into Adam:
    # integrations.checkpoint_guards.optimizer_kind).
    lion_dp2("optim_grads_params", checkpoint_root)
    flags = [flag if flag != "lion" else "soap" for flag in LION_FLAGS]
    with pytest.raises(TorchrunFailure) as failure:
        run_megatron(
            [
                *flags,
                *_strategy("optim_grads_params"),
                *("--load", str(checkpoint_root / "uninterrupted"), "--ckpt-step", str(SAVE_AT)),
            ],
            nproc=2,
        )
    text = str(failure.value)
    assert text.count("CheckpointMismatchError") >= 2, text[-4000:]
    assert "(saved by --optimizer lion)" in text and "this run's --optimizer soap keeps" in text


# --------------------------------------------------------------------------------------------------
# validate_args
# --------------------------------------------------------------------------------------------------

_BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 4 --train-iters 5 "
    "--lr 0.01 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--no-gradient-accumulation-fusion --use-megatron-fsdp --ckpt-format fsdp_dtensor "
)


def _validated(monkeypatch: pytest.MonkeyPatch, flags: str) -> argparse.Namespace:
    from megatron.training import arguments

    from megatron_muon.integrations import megatron_lm

    megatron_lm.install(cpu_stand_ins=False)
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["pretrain", *(_BASE + flags).split()])
    return arguments.validate_args(arguments.parse_args())


def test_validate_args_accepts_lion_with_megatron_fsdp(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _validated(monkeypatch, "--optimizer lion")
    assert args.optimizer == "lion" and args.use_megatron_fsdp
    assert not args.use_layer_wise_distributed_optimizer


def test_stock_lion_reads_the_lion_betas_after_install() -> None:
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.emerging_optimizers import _create_emerging_optimizer

    from megatron_muon.integrations import megatron_lm

    megatron_lm.install(cpu_stand_ins=False)
    config = OptimizerConfig(optimizer="lion", lr=0.1, lion_beta1=0.8, lion_beta2=0.7)
    param = torch.nn.Parameter(torch.zeros(2, 2))
    lion, _ = _create_emerging_optimizer(config, [{"params": [param]}], "lion", None, None)
    assert lion.param_groups[0]["betas"] == (0.8, 0.7)  # stock 0.19.2: (adam_beta1, adam_beta2)


# --------------------------------------------------------------------------------------------------
# custom trainer: the factory under megatron-core's FullyShardedDataParallel
# --------------------------------------------------------------------------------------------------


class LionReference(gpt_parity.Reference):
    """emerging-optimizers' ``Lion`` (the betas of ``lion_config()``) on the full matrices
    ``Reference`` gives Muon, its AdamW on the rest (no weight decay on 1-D params)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from emerging_optimizers.scalar_optimizers import Lion

        super().__init__(model)
        matrices = [
            p for n, p in model.named_parameters() if gpt_parity.reference_routes_to_muon(n, p)
        ]
        config = lion_config()
        lion = Lion(
            matrices,
            lr=gpt_parity.LR,
            betas=(config.lion_beta1, config.lion_beta2),
            weight_decay=gpt_parity.WEIGHT_DECAY,
        )
        self.optimizers = [lion, self.adamw]


def lion_config() -> Any:
    return gpt_parity.optimizer_config(optimizer="lion", lion_beta1=0.9, lion_beta2=0.97)


def _train_lion(rank: int, world_size: int) -> list[dict]:
    gpt_parity.init_megatron()
    results = []
    for strategy in STRATEGIES:
        result = gpt_parity.train(
            Run("mcore", strategy),
            rank,
            world_size,
            CUSTOM_STEPS,
            config=lion_config(),
            reference_class=LionReference,
        )
        results.append(result)
    # The MoE GPT: expert rows over expt_dp.
    moe = gpt_parity.train(
        Run("mcore", "optim_grads_params"),
        rank,
        world_size,
        CUSTOM_STEPS,
        True,
        config=lion_config(),
        reference_class=LionReference,
    )
    return [*results, moe]


@pytest.fixture(scope="module")
def custom_results() -> list[list[dict]]:
    return run_on_ranks(_train_lion, 2, timeout=600)


@pytest.mark.multirank
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_factory_lion_on_fully_sharded_data_parallel_matches_unsharded_lion(
    custom_results: list[list[dict]], strategy: str
) -> None:
    index = STRATEGIES.index(strategy)
    per_rank = [rank_results[index] for rank_results in custom_results]
    assert per_rank[0]["summary"][0].startswith("megatron-muon Lion:"), per_rank[0]["summary"]
    assert {optimizer for _, optimizer, _ in per_rank[0]["routing"]} == {"lion", "adam"}
    errors = gpt_parity.assert_within_floor(per_rank, per_rank[0]["floor"])
    worst = max(errors, key=errors.get)
    print(f"\n{strategy}: largest deviation {worst} {errors[worst]:.2e}")
    for rank, result in enumerate(per_rank):
        assert_steps_within_floor(f"{strategy} rank {rank}", result["stats"])
    if strategy != "no_shard":  # a Lion matrix with no rows on one rank: Lion on an empty shard
        lion = [
            gpt_parity._strip(n)
            for n, optimizer, _ in per_rank[0]["routing"]
            if optimizer == "lion"
        ]
        rows = [
            {name: stop - start for name, (start, stop, _, _) in r["deviations"].items()}
            for r in per_rank
        ]
        assert any(0 in (rows[0][name], rows[1][name]) for name in lion), rows


@pytest.mark.multirank
def test_factory_lion_on_an_moe_gpt_matches_unsharded_lion(
    custom_results: list[list[dict]],
) -> None:
    per_rank = [rank_results[len(STRATEGIES)] for rank_results in custom_results]
    routing = per_rank[0]["routing"]
    experts = [(n, o) for n, o, is_expert in routing if is_expert and ".experts." in n]
    assert len(experts) == 2 * gpt_parity.NUM_EXPERTS * 2, routing  # layers x experts x fc1/fc2
    assert {o for _, o in experts} == {"lion"}, experts
    # One megatron-core Lion over the dense and the expert row shards (elementwise: no group).
    assert per_rank[0]["summary"][0].startswith("megatron-muon Lion:"), per_rank[0]["summary"]
    errors = gpt_parity.assert_within_floor(per_rank, per_rank[0]["floor"])
    worst = max(errors, key=errors.get)
    print(f"\nMoE optim_grads_params: largest deviation {worst} {errors[worst]:.2e}")
    for rank, result in enumerate(per_rank):
        assert_steps_within_floor(f"MoE rank {rank}", result["stats"])

"""Megatron-LM's own training loop (``megatron.training.pretrain``) with ``--optimizer muon``.

Every launch runs ``examples/pretrain_gpt_megatron.py`` under ``torchrun`` on CPU/gloo ranks
(tiny GPT: 2 layers, hidden 64, mock data; ``tests/torchrun.py``) and reads the loop's own log
lines. These are the slowest tests of the project (a launch is 10-40 s on 2 shared cores), so one
launch serves several checks: the DP=1 Muon run (``muon_dp1``, tests/conftest.py, shared with
tests/test_megatron_lm_parallelism.py) is the reference of all four strategies, and the
optim_grads_params run also writes the checkpoints the resume test starts from.

Numerics: Muon runs with ``--muon-fp32-matmul-prec high``. Under the default "medium",
Newton-Schulz matmuls run in bf16 on CPU, and the summation-order differences of a DP=2 gradient
reduction (~1e-7 relative) flip bf16 roundings: DP=2 and DP=1 losses then drift apart by ~1e-4
within 5 steps. In fp32 they agree to every printed digit on the CPUs seen so far; the verdict is
**floor-judged** all the same (tests/run_comparison.py): DP=2 and DP=1 reduce the gradients in
another order, so each iteration's printed loss and full-precision grad norm is within
``FLOOR_FACTOR`` times what ``muon_dp1`` with every weight one ulp up (``muon_dp1_floor``, one
launch a session) grew to by then. Measured on an AVX2-only AMD Zen 3: grad norms at most 6.3e-7
apart, the floor 2.8e-7 at that iteration.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fsdp_models import STRATEGIES
from tests.megatron_lm_logs import assert_loss_falls, load_fsdp_dtensor_checkpoint, printed_lines
from tests.run_comparison import assert_runs_within_floor
from tests.torchrun import MUON_FLAGS, NUM_ITERS, MegatronRun, run_megatron

pytestmark = pytest.mark.timeout(900)

SAVE_AT = 3


def _strategy(name: str) -> list[str]:
    return ["--data-parallel-sharding-strategy", name]


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("megatron_lm_ckpt")


_DP2_RUNS: dict[str, MegatronRun] = {}


# One strategy runs the reference "gather" mode (every rank orthogonalizes every matrix), the
# others the default "owner" mode: both must equal the DP=1 run.
FSDP_MODE = {"optim_grads": "gather"}


def muon_dp2(strategy: str, checkpoint_root: Path) -> MegatronRun:
    """The DP=2 Muon run of ``strategy`` (optim_grads_params also saves at 3 and 6)."""
    if strategy not in _DP2_RUNS:
        extra = ["--muon-fsdp-mode", FSDP_MODE.get(strategy, "owner")]
        if strategy == "optim_grads_params":
            extra += ["--save", str(checkpoint_root / "uninterrupted"), "--save-interval", "3"]
        _DP2_RUNS[strategy] = run_megatron([*MUON_FLAGS, *_strategy(strategy), *extra], nproc=2)
    return _DP2_RUNS[strategy]


# --------------------------------------------------------------------------------------------------
# in-process: what install() patches and what it leaves alone
# --------------------------------------------------------------------------------------------------


def _parsed(monkeypatch: pytest.MonkeyPatch, flags: str) -> argparse.Namespace:
    from megatron.training import arguments

    monkeypatch.setattr(sys, "argv", ["pretrain", *flags.split()])
    return arguments.parse_args()


_BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 4 --train-iters 5 "
    "--lr 0.01 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--no-gradient-accumulation-fusion "
)
_FSDP = "--use-megatron-fsdp --ckpt-format fsdp_dtensor "


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``install()`` without CPU stand-ins (they patch torch.cuda for the whole process)."""
    from megatron.training import arguments

    from megatron_muon.integrations import megatron_lm

    megatron_lm.install(cpu_stand_ins=False)
    megatron_lm.install(cpu_stand_ins=False)  # idempotent: nothing is wrapped twice
    # validate_args asks the GPU's compute capability under Megatron-FSDP.
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 0)
    return arguments


def test_install_is_idempotent_and_wraps_each_function_once(installed: Any) -> None:
    from megatron.training import training

    validate = installed.validate_args
    assert not hasattr(validate.__wrapped__, "__wrapped__")
    assert not hasattr(installed.parse_args.__wrapped__, "__wrapped__")
    # Adam's state made rank-symmetric (checkpoint_guards.adam_state) around the routing.
    symmetric = training.get_megatron_optimizer
    assert symmetric._megatron_muon_rank_symmetric_state
    routed = symmetric.__wrapped__
    assert routed._megatron_muon_routed
    assert not hasattr(routed, "_megatron_muon_rank_symmetric_state")
    assert not hasattr(routed.__wrapped__, "_megatron_muon_routed")


def test_validate_args_accepts_muon_with_megatron_fsdp_only_after_install(
    installed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    stock = installed.validate_args.__wrapped__
    flags = _BASE + _FSDP + "--optimizer muon --data-parallel-sharding-strategy optim"
    with pytest.raises(AssertionError, match="Megatron-FSDP does not support the muon"):
        stock(_parsed(monkeypatch, flags))
    args = installed.validate_args(_parsed(monkeypatch, flags))
    assert args.optimizer == "muon"
    assert args.use_megatron_fsdp and args.ckpt_format == "fsdp_dtensor"
    assert not args.use_layer_wise_distributed_optimizer
    assert args.muon_fsdp_mode == "owner"  # our flags reach Megatron's parser


@pytest.mark.parametrize(
    "flags",
    [
        _BASE + _FSDP + "--optimizer adam --data-parallel-sharding-strategy optim_grads_params",
        _BASE + "--optimizer muon --ckpt-format torch_dist",
        _BASE + "--optimizer sgd",
    ],
    ids=["adam+fsdp", "muon-without-fsdp", "sgd"],
)
def test_validate_args_is_stock_for_every_other_combination(
    installed: Any, monkeypatch: pytest.MonkeyPatch, flags: str
) -> None:
    stock = installed.validate_args.__wrapped__
    expected = vars(stock(_parsed(monkeypatch, flags)))
    got = vars(installed.validate_args(_parsed(monkeypatch, flags)))
    assert got == expected


@pytest.mark.parametrize(
    ("flags", "error", "match"),
    [
        (_FSDP + "--optimizer muon --fp16", ValueError, "does not support --fp16"),
        (
            _FSDP + "--optimizer muon --global-batch-size 5 --micro-batch-size 2",
            AssertionError,
            "must be divisible by",
        ),
    ],
    ids=["fp16-with-muon", "global-batch-not-divisible"],
)
def test_bad_muon_flags_get_clear_errors(
    installed: Any, monkeypatch: pytest.MonkeyPatch, flags: str, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        installed.validate_args(_parsed(monkeypatch, _BASE + flags))


def test_unknown_optimizer_is_rejected_by_the_parser(
    installed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SystemExit):
        _parsed(monkeypatch, _BASE + _FSDP + "--optimizer adamuon")


def test_install_refuses_an_unchecked_megatron_core_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.core import package_info

    from megatron_muon.integrations import megatron_lm

    for version in ("0.20.0", "0.18.3", "0.19.0rc1"):
        monkeypatch.setattr(package_info, "__version__", version)
        with pytest.raises(RuntimeError, match=f"megatron-core {version} is installed") as error:
            megatron_lm.install(cpu_stand_ins=False)
        assert "megatron-core >=0.19.0,<0.20" in str(error.value)


def test_install_accepts_every_checked_megatron_core_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.core import package_info

    from megatron_muon.integrations import megatron_lm

    for version in ("0.19.0", "0.19.2", "0.19.2+5e1a2b3"):
        monkeypatch.setattr(package_info, "__version__", version)
        megatron_lm.install(cpu_stand_ins=False)


def test_loss_check_rejects_a_flat_no_shard_run() -> None:
    # Stock megatron-core 0.19.2's Muon under no_shard on 2 ranks: the same loss every iteration.
    with pytest.raises(AssertionError, match="did not fall"):
        assert_loss_falls([5.56916] * 5)


# --------------------------------------------------------------------------------------------------
# torchrun: the real loop
# --------------------------------------------------------------------------------------------------


@pytest.mark.multirank
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_muon_loss_falls_and_equals_dp1_for_each_strategy(
    strategy: str, muon_dp1: MegatronRun, muon_dp1_floor: MegatronRun, checkpoint_root: Path
) -> None:
    """Floor-judged (module docstring)."""
    run = muon_dp2(strategy, checkpoint_root)
    losses = run.series("lm loss")
    print(
        f"\n{strategy} DP=2 lm loss: {losses}\n{'':{len(strategy)}} DP=1 lm loss: "
        f"{muon_dp1.series('lm loss')}  ({run.wall_s:.1f} s)"
    )
    assert sorted(run.iterations) == list(range(1, NUM_ITERS + 1))
    # install() routed the loop's get_megatron_optimizer to our factory, with our flag's mode.
    for described in run.optimizers.values():
        assert described["class"] == "MegatronCheckpointedOptimizer", described
        mode = FSDP_MODE.get(strategy, "owner")
        assert any(f"mode {mode}" in line for line in described["summary"]), described
    assert_loss_falls(losses)
    assert_runs_within_floor(f"muon {strategy} DP=2 vs DP=1", run, muon_dp1, muon_dp1_floor)
    # The learned absolute position embedding (Megatron's default --position-embedding-type):
    # megatron-core's own Muon takes it, ours gives it to AdamW, and says so once, on rank 0.
    routing_lines = printed_lines(run, 0, "megatron-muon routing:")
    assert routing_lines == [
        "megatron-muon routing: module.module.embedding.position_embeddings.weight -> adam "
        "(megatron-core's own optimizer: muon): an embedding without megatron-core's "
        "is_embedding_or_output_parameter tag, as the learned absolute position embedding is; "
        "see docs/exactness.md"
    ], routing_lines
    assert printed_lines(run, 1, "megatron-muon routing:") == []


@pytest.mark.multirank
def test_resume_from_fsdp_dtensor_checkpoint_is_bit_identical(checkpoint_root: Path) -> None:
    uninterrupted = muon_dp2("optim_grads_params", checkpoint_root)
    # A Muon matrix that some rank holds no rows of: its state must still exist on that rank.
    empty_on_some_rank = [
        name
        for name, (rows, total) in uninterrupted.layouts[0].items()
        if "linear_" in name
        and name.endswith("weight")
        and total > 0
        and 0 in (rows, uninterrupted.layouts[1][name][0])
    ]
    assert empty_on_some_rank, uninterrupted.layouts

    resumed = run_megatron(
        [
            *MUON_FLAGS,
            *_strategy("optim_grads_params"),
            *("--load", str(checkpoint_root / "uninterrupted"), "--ckpt-step", str(SAVE_AT)),
            # The CPU RNG stand-in's CUDA state is a dummy; Megatron exits with rc=0 (having
            # trained nothing) when it cannot restore it, so RNG state is not loaded.
            "--no-load-rng",
            *("--save", str(checkpoint_root / "resumed"), "--save-interval", "3"),
        ],
        nproc=2,
    )
    assert sorted(resumed.iterations) == list(range(SAVE_AT + 1, NUM_ITERS + 1))
    # The full-precision grad norms (the driver's record), bitwise.
    assert resumed.grad_norms == uninterrupted.grad_norms[SAVE_AT:NUM_ITERS]
    # Megatron logs the first iteration after a start without resetting its loss sum, so the
    # next line prints the mean of both (in the uninterrupted run too, at iteration 2).
    first, second = SAVE_AT + 1, SAVE_AT + 2
    assert resumed.iterations[first]["lm loss"] == uninterrupted.iterations[first]["lm loss"]
    for iteration in range(second + 1, NUM_ITERS + 1):
        assert (
            resumed.iterations[iteration]["lm loss"]
            == (uninterrupted.iterations[iteration]["lm loss"])
        )

    final = f"iter_{NUM_ITERS:07d}"
    expected = load_fsdp_dtensor_checkpoint(checkpoint_root / "uninterrupted" / final)
    got = load_fsdp_dtensor_checkpoint(checkpoint_root / "resumed" / final)
    tensors = sorted(k for k, v in expected.items() if torch.is_tensor(v))
    assert sorted(k for k, v in got.items() if torch.is_tensor(v)) == tensors
    momentum = [k for k in tensors if k.endswith("momentum_buffer")]
    params = [k for k in tensors if k.startswith("model.") and "linear_" in k]
    assert momentum and params
    for name in empty_on_some_rank:
        short = name.split("module.module.", 1)[-1]
        assert any(short in k for k in momentum), (short, momentum)
    differing = [k for k in tensors if not torch.equal(got[k], expected[k])]
    assert not differing, f"resumed run differs from the uninterrupted one in {differing}"
    print(
        f"\nresume: {len(tensors)} tensors bit-identical ({len(momentum)} Muon momentum buffers, "
        f"{len(params)} linear params); rows 0 on a rank: {empty_on_some_rank}"
    )


@pytest.mark.multirank
def test_stock_adam_with_megatron_fsdp_is_unchanged_by_install() -> None:
    flags = [
        *("--optimizer adam --lr 0.01 --train-iters 4").split(),
        *_strategy("optim"),
    ]
    stock = run_megatron(flags, nproc=2, install=False)
    with_install = run_megatron(flags, nproc=2, install=True)
    assert stock.iterations == with_install.iterations
    for run in (stock, with_install):
        # megatron-core's own optimizer for Adam on Megatron-FSDP, not ours.
        assert {d["class"] for d in run.optimizers.values()} == {"DistributedOptimizer"}
    losses = stock.series("lm loss")
    assert losses[-1] < losses[0], losses


def test_only_megatron_fsdp_chunks_count_as_megatron_fsdp() -> None:
    from megatron_muon.common.megatron_fsdp_compat import uses_megatron_fsdp

    assert not uses_megatron_fsdp([torch.nn.Linear(4, 4)])
    assert not uses_megatron_fsdp(torch.nn.Linear(4, 4))

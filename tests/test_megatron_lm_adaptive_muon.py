"""``--optimizer adaptive_muon`` in Megatron-LM's own loop, with and without Megatron-FSDP.

The reference of each second-moment method is megatron-core's own ``TensorParallelAdaptiveMuon``
with its crash fixed (``integrations.adaptive_muon_fix``, which ``install()`` registers) on one rank
without Megatron-FSDP; ours is ``ShardedAdaptiveMuon`` under ``--use-megatron-fsdp --ckpt-format
fsdp_dtensor`` at DP=2, one sharding strategy per method (and the gather mode once). 8 iterations'
losses and grad norms agree to the printed digits (``RELATIVE_TOLERANCE``; Newton-Schulz in fp32,
``--muon-fp32-matmul-prec high``: tests/test_megatron_lm_loop.py says why). The GPT uses rotary
position embeddings: stock megatron-core routes a learned position embedding to the matrix
optimizer (it carries no embedding tag) where ours routes it to AdamW (``fsdp.routing``).

The normuon run saves at 4 and 8; a run resumed from 4 in fresh processes prints the same losses
and saves bitwise the same state (second moments included) at 8. Launches: 3 one-rank references,
3 DP=2 runs, 1 resume.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.megatron_lm_logs import (
    assert_loss_falls,
    assert_same_losses,
    load_fsdp_dtensor_checkpoint,
)
from tests.muon_reference import full_tensor
from tests.torchrun import DRIVER, TINY_GPT_CPU_FLAGS, MegatronRun, run_megatron

pytestmark = pytest.mark.timeout(900)

METHODS = ("adamuon", "normuon", "namo")
NUM_ITERS, SAVE_AT = 8, 4
# One strategy per method (launches are the slowest tests); adamuon also runs the gather mode.
STRATEGY = {"adamuon": "optim_grads", "normuon": "optim_grads_params", "namo": "optim"}
FSDP_MODE = {"adamuon": "gather"}
_FSDP_ONLY = ("--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor")
# adamuon's first update is sign(NS result) / sqrt(1 - beta2) per element, times Muon's scale: at
# lr 0.02 it moves each weight by ~0.5, and from there the DP=1 and DP=2 reduction orders part the
# losses from iteration 3 (4.90456 vs 4.904685, measured); at 0.001 they agree to 2e-6 and the loss
# still falls 10% in 5 iterations.
LR = {"adamuon": "0.001"}


def _flags(method: str) -> list[str]:
    return [
        *("--optimizer adaptive_muon --muon-fp32-matmul-prec high --lr").split(),
        LR.get(method, "0.02"),
        *("--adaptive-muon-moment2-method", method, "--adaptive-muon-beta2", "0.9"),
        *("--position-embedding-type rope --train-iters").split(),
        str(NUM_ITERS),
    ]


_RUNS: dict[tuple[str, str], MegatronRun] = {}


def _stock(method: str) -> MegatronRun:
    """One rank, no Megatron-FSDP: megatron-core's optimizer (the fixed adaptive-Muon class)."""
    if ("stock", method) not in _RUNS:
        flags = [f for f in TINY_GPT_CPU_FLAGS if f not in _FSDP_ONLY]
        _RUNS[("stock", method)] = run_megatron(
            [*flags, *_flags(method)], nproc=1, entry=[str(DRIVER)], entry_prints_done_marker=True
        )
    return _RUNS[("stock", method)]


def _ours(method: str, checkpoint_root: Path) -> MegatronRun:
    """DP=2 under Megatron-FSDP (normuon also saves at 4 and 8)."""
    if ("fsdp", method) not in _RUNS:
        extra = ["--data-parallel-sharding-strategy", STRATEGY[method]]
        extra += ["--muon-fsdp-mode", FSDP_MODE.get(method, "owner")]
        if method == "normuon":
            extra += ["--save", str(checkpoint_root / "uninterrupted")]
            extra += ["--save-interval", str(SAVE_AT)]
        _RUNS[("fsdp", method)] = run_megatron([*_flags(method), *extra], nproc=2)
    return _RUNS[("fsdp", method)]


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adaptive_muon_ckpt")


# --------------------------------------------------------------------------------------------------
# in-process: the stock class's fix, the flags, validate_args
# --------------------------------------------------------------------------------------------------


def _stock_step(optimizer_cls: type, method: str) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(full_tensor(shape, seed=i)) for i, shape in enumerate(_SHAPES)]
    kwargs = dict(lr=0.02, momentum=0.9, weight_decay=0.05, nesterov=True)
    kwargs |= dict(fp32_matmul_prec="highest", moment2_method=method, beta2=0.9)
    optimizer = optimizer_cls(params, **kwargs)
    for step in range(2):
        for i, p in enumerate(params):
            p.grad = full_tensor(p.shape, seed=100 * step + i + 7)
        optimizer.step()
    return [p.detach() for p in params]


_SHAPES = [(24, 8), (8, 24)]


@pytest.mark.parametrize("method", METHODS)
def test_fixed_stock_class_steps_as_adaptive_muon_where_the_stock_one_crashes(method: str) -> None:
    from emerging_optimizers.orthogonalized_optimizers import AdaptiveMuon
    from megatron.core.optimizer.emerging_optimizers import TensorParallelAdaptiveMuon

    from megatron_muon.integrations.adaptive_muon_fix import TensorParallelAdaptiveMuonFixed

    with pytest.raises(AttributeError, match="scale_mode"):
        _stock_step(TensorParallelAdaptiveMuon, method)
    fixed = _stock_step(TensorParallelAdaptiveMuonFixed, method)
    reference = _stock_step(AdaptiveMuon, method)
    for mine, expected in zip(fixed, reference, strict=True):
        assert torch.equal(mine, expected)  # the same functions on the same tensors


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Any:
    from megatron.training import arguments

    from megatron_muon.integrations import megatron_lm

    megatron_lm.install(cpu_stand_ins=False)
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 0)
    return arguments


_BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 4 --train-iters 5 "
    "--lr 0.01 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--no-gradient-accumulation-fusion --use-megatron-fsdp --ckpt-format fsdp_dtensor "
    "--optimizer adaptive_muon "
)


def test_validate_args_accepts_adaptive_muon_with_megatron_fsdp_and_its_flags(
    installed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron.core.optimizer.emerging_optimizers import _EMERGING_OPTIMIZERS
    from megatron.training.training import get_megatron_optimizer_config

    from megatron_muon.integrations.adaptive_muon_fix import TensorParallelAdaptiveMuonFixed

    flags = _BASE + "--adaptive-muon-moment2-method namo --adaptive-muon-eps 1e-6"
    monkeypatch.setattr(sys, "argv", ["pretrain", *flags.split()])
    args = installed.validate_args(installed.parse_args())
    assert args.optimizer == "adaptive_muon" and args.use_megatron_fsdp
    config, _ = get_megatron_optimizer_config(args)
    assert (config.adaptive_muon_moment2_method, config.adaptive_muon_eps) == ("namo", 1e-6)
    assert config.adaptive_muon_beta2 == 0.95  # megatron-core's default
    assert _EMERGING_OPTIMIZERS["adaptive_muon"].optimizer_cls is TensorParallelAdaptiveMuonFixed

    monkeypatch.setattr(sys, "argv", ["pretrain", *(_BASE + "--adaptive-muon-beta2 1").split()])
    with pytest.raises(ValueError, match="adaptive_muon_beta2 must be in"):
        installed.validate_args(installed.parse_args())
    monkeypatch.setattr(
        sys, "argv", ["pretrain", *(_BASE + "--adaptive-muon-moment2-method adam").split()]
    )
    with pytest.raises(SystemExit):
        installed.parse_args()


# --------------------------------------------------------------------------------------------------
# torchrun: the real loop
# --------------------------------------------------------------------------------------------------


@pytest.mark.multirank
@pytest.mark.parametrize("method", METHODS)
def test_adaptive_muon_on_megatron_fsdp_equals_the_stock_optimizer_on_one_rank(
    method: str, checkpoint_root: Path
) -> None:
    reference, run = _stock(method), _ours(method, checkpoint_root)
    losses = run.series("lm loss")
    print(
        f"\n{method} DP=2 {STRATEGY[method]}: {losses}\n{method} stock DP=1: "
        f"{reference.series('lm loss')} ({run.wall_s:.0f} s, {reference.wall_s:.0f} s)"
    )
    assert sorted(run.iterations) == list(range(1, NUM_ITERS + 1))
    assert reference.optimizers[0]["class"] == "ChainedOptimizer"  # megatron-core's own
    for described in run.optimizers.values():
        assert any(f"AdaptiveMuon({method})[dense]" in line for line in described["summary"])
    assert_loss_falls(losses)
    assert_same_losses(losses, reference.series("lm loss"))
    assert_same_losses(run.series("grad norm"), reference.series("grad norm"))


@pytest.mark.multirank
def test_adaptive_muon_resumes_bitwise_from_fsdp_dtensor_checkpoint(checkpoint_root: Path) -> None:
    uninterrupted = _ours("normuon", checkpoint_root)
    resumed = run_megatron(
        [
            *_flags("normuon"),
            *("--data-parallel-sharding-strategy", STRATEGY["normuon"]),
            *("--load", str(checkpoint_root / "uninterrupted"), "--ckpt-step", str(SAVE_AT)),
            "--no-load-rng",  # the CPU RNG stand-in's CUDA state is a dummy
            *("--save", str(checkpoint_root / "resumed"), "--save-interval", str(SAVE_AT)),
        ],
        nproc=2,
    )
    assert sorted(resumed.iterations) == list(range(SAVE_AT + 1, NUM_ITERS + 1))
    for iteration in range(SAVE_AT + 1, NUM_ITERS + 1):
        expected = uninterrupted.iterations[iteration]
        assert resumed.iterations[iteration]["grad norm"] == expected["grad norm"]
        # Megatron's first log line after a start averages two iterations' losses (see
        # tests/test_megatron_lm_loop.py): iteration SAVE_AT + 2 is not compared.
        if iteration != SAVE_AT + 2:
            assert resumed.iterations[iteration]["lm loss"] == expected["lm loss"]
    final = f"iter_{NUM_ITERS:07d}"
    expected_state = load_fsdp_dtensor_checkpoint(checkpoint_root / "uninterrupted" / final)
    got = load_fsdp_dtensor_checkpoint(checkpoint_root / "resumed" / final)
    tensors = sorted(k for k, v in expected_state.items() if torch.is_tensor(v))
    assert sorted(k for k, v in got.items() if torch.is_tensor(v)) == tensors
    moment2 = [k for k in tensors if k.endswith("moment2_buffer")]
    assert moment2, tensors
    differing = [k for k in tensors if not torch.equal(got[k], expected_state[k])]
    assert not differing, f"resumed run differs from the uninterrupted one in {differing}"

"""``--optimizer soap --use-megatron-fsdp`` in Megatron-LM's own loop.

In process: ``validate_args`` accepts ``--optimizer soap --use-megatron-fsdp`` and the
``--soap-*`` flags (megatron-core's ``OptimizerConfig.soap_*``, which Megatron-LM's parser lacks),
and refuses a ``--soap-precondition-frequency`` that SOAP would ignore, naming it.

Launched: ``ShardedSOAP`` + AdamW under ``--use-megatron-fsdp --ckpt-format fsdp_dtensor`` at
DP=2 trains (the loss falls; the build summary names SOAP), saving at 4 and 8; a run resumed from 4
in fresh processes prints the same losses and saves bitwise the same state (every SOAP tensor
included) at 8. Two launches.

Not compared step by step with megatron-core's own soap on one rank: SOAP's update amplifies a
gradient's last-bit differences to O(1) (its first step is Adam, ``g / (|g| + 1e-8)``, in the
eigenbasis of ``L = G G^T``, whose null space holds only rounding noise: a ``(192, 64)``
``linear_qkv`` has 128 zero eigenvalues), so the stock soap itself at DP=1 and at DP=2 (Megatron's
DDP, ``--clip-grad 0``) differs from iteration 2 on (losses 4.839392 and 4.843491, measured), and
ours at DP=2 against stock at DP=1 likewise (4.839582 and 4.841638; the first iteration's loss
and grad norm equal). That ours steps exactly as stock SOAP given the same gradients is
tests/test_factory_soap.py's claim (bitwise, every strategy).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.megatron_lm_logs import assert_loss_falls, assert_resumed_bitwise
from tests.torchrun import MegatronRun, run_megatron

pytestmark = pytest.mark.timeout(900)

NUM_ITERS, SAVE_AT = 8, 4
STRATEGY = "optim_grads_params"
FLAGS = [
    *("--optimizer soap --lr 0.01 --soap-shampoo-beta 0.9").split(),
    *("--position-embedding-type rope --train-iters").split(),
    str(NUM_ITERS),
]


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("soap_ckpt")


@pytest.fixture(scope="module")
def fsdp_soap(checkpoint_root: Path) -> MegatronRun:
    """DP=2 under Megatron-FSDP, saving at 4 and 8."""
    extra = ["--data-parallel-sharding-strategy", STRATEGY]
    extra += ["--save", str(checkpoint_root / "uninterrupted"), "--save-interval", str(SAVE_AT)]
    return run_megatron([*FLAGS, *extra], nproc=2)


_BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 4 --train-iters 5 "
    "--lr 0.01 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--no-gradient-accumulation-fusion --use-megatron-fsdp --ckpt-format fsdp_dtensor "
    "--optimizer soap "
)


def test_validate_args_accepts_soap_with_megatron_fsdp_and_its_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.training import arguments
    from megatron.training.training import get_megatron_optimizer_config

    from megatron_muon.integrations import megatron_lm

    megatron_lm.install(cpu_stand_ins=False)
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 0)
    flags = _BASE + "--soap-shampoo-beta 0.8 --soap-no-use-kl-shampoo"
    monkeypatch.setattr(sys, "argv", ["pretrain", *flags.split()])
    args = arguments.validate_args(arguments.parse_args())
    assert args.optimizer == "soap" and args.use_megatron_fsdp
    config, _ = get_megatron_optimizer_config(args)
    assert (config.soap_shampoo_beta, config.soap_use_kl_shampoo) == (0.8, False)
    assert config.soap_precondition_frequency == 1  # megatron-core's default
    flags = _BASE + "--soap-precondition-frequency 10"
    monkeypatch.setattr(sys, "argv", ["pretrain", *flags.split()])
    with pytest.raises(ValueError, match="soap_precondition_frequency must be 1, got 10"):
        arguments.validate_args(arguments.parse_args())


@pytest.mark.multirank
def test_soap_on_megatron_fsdp_trains(fsdp_soap: MegatronRun) -> None:
    losses = fsdp_soap.series("lm loss")
    print(f"\nsoap DP=2 {STRATEGY}: {losses} ({fsdp_soap.wall_s:.0f} s)")
    assert sorted(fsdp_soap.iterations) == list(range(1, NUM_ITERS + 1))
    for described in fsdp_soap.optimizers.values():
        assert any("SOAP[dense]" in line for line in described["summary"])
    assert_loss_falls(losses)


@pytest.mark.multirank
def test_soap_resumes_bitwise_from_fsdp_dtensor_checkpoint(
    fsdp_soap: MegatronRun, checkpoint_root: Path
) -> None:
    uninterrupted = fsdp_soap
    resumed = run_megatron(
        [
            *FLAGS,
            *("--data-parallel-sharding-strategy", STRATEGY),
            *("--load", str(checkpoint_root / "uninterrupted"), "--ckpt-step", str(SAVE_AT)),
            "--no-load-rng",  # the CPU RNG stand-in's CUDA state is a dummy
            *("--save", str(checkpoint_root / "resumed"), "--save-interval", str(SAVE_AT)),
        ],
        nproc=2,
    )
    tensors = assert_resumed_bitwise(uninterrupted, resumed, checkpoint_root, SAVE_AT, NUM_ITERS)
    eigenbases = [k for k in tensors if k.endswith(".Q_L")]
    assert len(eigenbases) == 8, tensors  # every SOAP matrix's state is in the checkpoint

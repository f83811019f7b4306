"""``--optimizer laprop|oblique_sgd|oblique_adam --use-megatron-fsdp`` in Megatron-LM's own loop.

In process: after ``install()`` Megatron's ``--optimizer`` takes the three names, ``validate_args``
accepts them with Megatron-FSDP, their settings are flags derived from one definition each
(``optimizers.laprop.LaPropConfig``, ``optimizers.oblique.ObliqueSGDConfig`` /
``ObliqueAdamConfig``: ``--laprop-eps``, ``--oblique-adam-dim``, ...) that reach the optimizer
(``settings_onto_config``), and a value the settings refuse stops ``validate_args`` naming it.

Launched: each trains the tiny GPT at DP=2 under ``optim_grads_params`` with
``--ckpt-format fsdp_dtensor`` for ``NUM_ITERS`` iterations: its build summary names the class, the
flags' values and the strategy, and the loss falls. That each steps exactly as its class is
tests/test_sharded_rowwise.py's and tests/test_factory_rowwise.py's claim; resuming and
resharding, tests/test_rowwise_checkpoint.py's. Three launches.
"""

from __future__ import annotations

import sys

import pytest

from tests.megatron_lm_logs import assert_loss_falls
from tests.torchrun import run_megatron

pytestmark = pytest.mark.timeout(900)

NUM_ITERS = 6
# name -> (its flags, the settings line the build summary prints)
RUNS = {
    "laprop": (
        "--lr 0.003 --laprop-eps 1e-7",
        "LaPropConfig(eps=1e-07, correct_bias=True, weight_decay_method='decoupled')",
    ),
    "oblique_sgd": (
        "--lr 0.05 --sgd-momentum 0.8 --oblique-sgd-dim 1",
        "ObliqueSGDConfig(dim=1, eps=1e-08, weight_decay_method='decoupled')",
    ),
    "oblique_adam": (
        "--lr 0.01 --oblique-adam-no-correct-bias",
        "ObliqueAdamConfig(dim=0, eps=1e-08, correct_bias=False, weight_decay_method='decoupled')",
    ),
}
_BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 4 --train-iters 5 "
    "--lr 0.01 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--no-gradient-accumulation-fusion --use-megatron-fsdp --ckpt-format fsdp_dtensor "
)


def _parsed(monkeypatch: pytest.MonkeyPatch, flags: str):
    from megatron.training import arguments

    from megatron_muon.integrations import megatron_lm

    megatron_lm.install(cpu_stand_ins=False)
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["pretrain", *(_BASE + flags).split()])
    return arguments.validate_args(arguments.parse_args())


@pytest.mark.parametrize("name", RUNS)
def test_validate_args_accepts_each_with_megatron_fsdp_and_its_flags_reach_the_optimizer(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    from megatron.training.training import get_megatron_optimizer_config

    from megatron_muon.fsdp.arguments import settings_onto_config
    from megatron_muon.fsdp.rowwise_optimizers import ROWWISE_SETTINGS
    from megatron_muon.optimizers.settings import read_settings

    flags, settings = RUNS[name]
    args = _parsed(monkeypatch, f"--optimizer {name} {flags}")
    assert args.optimizer == name and args.use_megatron_fsdp
    assert not args.use_layer_wise_distributed_optimizer
    config, _ = get_megatron_optimizer_config(args)
    settings_onto_config(args, config)
    assert repr(read_settings(ROWWISE_SETTINGS[name], config)) == settings


def test_a_setting_the_optimizer_refuses_stops_validate_args_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="oblique_sgd_dim must be 0 .columns. or 1 .rows., got 2"):
        _parsed(monkeypatch, "--optimizer oblique_sgd --oblique-sgd-dim 2")
    with pytest.raises(ValueError, match="laprop_eps must be >= 0, got -1.0"):
        _parsed(monkeypatch, "--optimizer laprop --laprop-eps -1")


@pytest.mark.multirank
@pytest.mark.parametrize("name", RUNS)
def test_megatron_lms_loop_trains_each_at_dp2_by_name(name: str) -> None:
    from megatron_muon.fsdp.rowwise_optimizers import ROWWISE_OPTIMIZERS

    flags, settings = RUNS[name]
    run = run_megatron(
        [
            *f"--optimizer {name} {flags} --position-embedding-type rope".split(),
            *("--data-parallel-sharding-strategy", "optim_grads_params"),
            *("--train-iters", str(NUM_ITERS)),
        ],
        nproc=2,
    )
    losses = run.series("lm loss")
    print(f"\n{name} DP=2: {losses} ({run.wall_s:.0f} s)")
    assert sorted(run.iterations) == list(range(1, NUM_ITERS + 1))
    summary = run.optimizers[0]["summary"]
    label = ROWWISE_OPTIMIZERS[name].label
    assert summary[0].startswith(f"megatron-muon {label}[dense]:"), summary
    assert summary[-1].startswith("megatron-muon AdamW:"), summary
    assert f"({settings}), strategy optim_grads_params" in summary[0], summary
    assert_loss_falls(losses, NUM_ITERS)

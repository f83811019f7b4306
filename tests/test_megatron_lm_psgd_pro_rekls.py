"""``--optimizer psgd_pro`` and ``--optimizer rekls`` with ``--use-megatron-fsdp`` in Megatron-LM's
own loop, after ``install()``.

In process: megatron-core 0.19.2's ``--optimizer`` choices lack both; ``install()`` widens them
(as ``--muon-tp-mode``'s), ``validate_args`` accepts them with Megatron-FSDP and their
``--psgd-pro-*`` / ``--rekls-*`` flags (``PsgdProConfig``, ``RekLsConfig``), refuses a bad value
naming its field, and the values reach the ``OptimizerConfig`` the factory reads (megatron-core's
has no such fields; ``fsdp.arguments.settings_onto_config``).

Launched: each at DP=2 (optim_grads_params), 5 iterations; the build summary names the optimizer
on the dense matrices. psgd_pro, its hyperparameters as flags: the loss falls (megatron-core's own
psgd_pro cannot build). rekls against megatron-core's own rekls on one rank (DDP), as SOAP's
(tests/test_megatron_lm_soap.py): the same gradient bits and steps, so the printed losses
**bitwise**, the full-precision grad norms (an fp32 norm on shards against one on whole tensors)
**floor-judged** against stock with every weight one ulp up (tests/run_comparison.py). Their
exactness, resume and reshard are checked on the factory and the
toy (tests/test_factory_psgd_pro_rekls.py, tests/test_psgd_pro_rekls_checkpoint.py). Four
launches.
"""

from __future__ import annotations

import sys

import pytest

from tests.megatron_lm_logs import assert_loss_falls
from tests.run_comparison import FULL_PRECISION_GUARD, assert_within_floor, floor_run, grad_norms
from tests.torchrun import MegatronRun, run_megatron

pytestmark = pytest.mark.timeout(600)

NUM_ITERS = 5
PSGD_FLAGS = "--lr 0.003 --psgd-pro-warmup-steps 10 --psgd-pro-damping-noise-scale 0.01"
REKLS_FLAGS = "--lr 0.01 --micro-batch-size 2 --clip-grad 0 --position-embedding-type rope"
LABELS = {"psgd_pro": "PSGDPro", "rekls": "REKLS"}

_BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 4 --train-iters 5 "
    "--lr 0.01 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--no-gradient-accumulation-fusion --use-megatron-fsdp --ckpt-format fsdp_dtensor "
)


def test_validate_args_accepts_psgd_pro_and_rekls_with_megatron_fsdp_and_their_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.training import arguments
    from megatron.training.training import get_megatron_optimizer_config

    from megatron_muon.fsdp.arguments import settings_onto_config
    from megatron_muon.integrations import megatron_lm

    megatron_lm.install(cpu_stand_ins=False)
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 0)
    flags = _BASE + "--optimizer psgd_pro --psgd-pro-beta-lip 0.8 --psgd-pro-warmup-steps 7"
    monkeypatch.setattr(sys, "argv", ["pretrain", *flags.split()])
    args = arguments.validate_args(arguments.parse_args())
    assert args.optimizer == "psgd_pro" and args.use_megatron_fsdp
    config, _ = get_megatron_optimizer_config(args)
    settings_onto_config(args, config)
    assert (config.psgd_pro_beta_lip, config.psgd_pro_warmup_steps) == (0.8, 7)
    assert config.psgd_pro_momentum == 0.9  # PSGDPro's default
    flags = _BASE + "--optimizer rekls --rekls-shampoo-beta 0.8"
    monkeypatch.setattr(sys, "argv", ["pretrain", *flags.split()])
    args = arguments.validate_args(arguments.parse_args())
    config, _ = get_megatron_optimizer_config(args)
    settings_onto_config(args, config)
    assert (args.optimizer, config.rekls_shampoo_beta) == ("rekls", 0.8)
    flags = _BASE + "--optimizer psgd_pro --psgd-pro-beta-lip 1.5"
    monkeypatch.setattr(sys, "argv", ["pretrain", *flags.split()])
    with pytest.raises(ValueError, match="psgd_pro_beta_lip must be in"):
        arguments.validate_args(arguments.parse_args())


def _dp2(name: str, flags: str) -> MegatronRun:
    """``--optimizer name`` at DP=2 under Megatron-FSDP (optim_grads_params); its summary names
    the optimizer on the dense matrices."""
    run = run_megatron(
        [
            *f"--optimizer {name} {flags}".split(),
            *("--data-parallel-sharding-strategy", "optim_grads_params"),
            *("--train-iters", str(NUM_ITERS)),
        ],
        nproc=2,
    )
    assert sorted(run.iterations) == list(range(1, NUM_ITERS + 1))
    for described in run.optimizers.values():
        summary = described["summary"]
        assert any(f"{LABELS[name]}[dense]" in line for line in summary), summary
    return run


@pytest.mark.multirank
def test_psgd_pro_trains_by_name_in_megatron_lms_loop_at_dp2() -> None:
    """megatron-core's own psgd_pro cannot build (it passes ``betas``): the loss falls."""
    run = _dp2("psgd_pro", PSGD_FLAGS)
    assert_loss_falls(run.series("lm loss"), NUM_ITERS)


@pytest.mark.multirank
def test_rekls_in_megatron_lms_loop_at_dp2_equals_stock_rekls_on_one_rank() -> None:
    """Like-for-like with megatron-core's own rekls (DDP, one rank; ``install()`` widens its
    ``--optimizer`` choices): the same gradient bits on both sides, as for SOAP
    (tests/test_megatron_lm_soap.py: one micro-batch per rank, ``--clip-grad 0``, RoPE), and
    REKLS's default shampoo_beta (megatron-core's path reads no ``--rekls-*`` flag). Bitwise
    losses, floor-judged grad norms (module docstring)."""
    run = _dp2("rekls", REKLS_FLAGS)
    flags = [*f"--optimizer rekls {REKLS_FLAGS}".split(), "--train-iters", str(NUM_ITERS)]
    stock = run_megatron(flags, nproc=1, megatron_fsdp=False)
    floor = floor_run(flags, nproc=1, megatron_fsdp=False)
    assert run.series("lm loss") == stock.series("lm loss")
    assert_within_floor(
        "rekls DP=2 vs stock DP=1 grad norm",
        grad_norms(run),
        grad_norms(stock),
        grad_norms(floor),
        guard=FULL_PRECISION_GUARD,
    )

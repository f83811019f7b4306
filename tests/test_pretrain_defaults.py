"""The pretrain entry point's defaults: what it fills in, what the user's flags keep, refusals.

``default_flags`` is run on Megatron's real parser (with megatron-muon's and the entry point's
flags), as ``megatron_muon.pretrain.main`` runs it; no process group, no launch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_muon.cli.pretrain_defaults import BYTE_DATA_FLAGS, CPU_FLAGS, default_flags
from tests.torchrun import REPO

MODEL_AND_RUN_LENGTH = [
    *("--optimizer muon --num-layers 2 --hidden-size 64 --num-attention-heads 4").split(),
    *("--seq-length 64 --micro-batch-size 4 --global-batch-size 8 --train-iters 40").split(),
    *("--lr 0.02").split(),
]


def _defaults(
    flags: list[str], has_gpu: bool = False, has_te: bool = True
) -> list[tuple[str, ...]]:
    from megatron_muon.cli.pretrain_args import parser

    return default_flags(parser(), flags, has_gpu=has_gpu, has_te=has_te)


def test_model_and_run_length_flags_get_megatron_fsdp_and_every_run_default():
    assert _defaults(MODEL_AND_RUN_LENGTH) == [
        *CPU_FLAGS,
        *BYTE_DATA_FLAGS,
        ("--use-megatron-fsdp",),
        ("--ckpt-format", "fsdp_dtensor"),
        ("--max-position-embeddings", "64"),
        ("--eval-interval", "10"),
        ("--eval-iters", "10"),
        ("--log-interval", "4"),
    ]


def test_with_a_gpu_no_cpu_flags_are_added():
    defaults = _defaults(MODEL_AND_RUN_LENGTH, has_gpu=True)
    assert not set(CPU_FLAGS) & set(defaults)
    assert ("--use-megatron-fsdp",) in defaults


def test_flags_the_user_gives_are_never_defaulted():
    given = [
        *MODEL_AND_RUN_LENGTH,
        *("--ckpt-format torch_dist --max-position-embeddings 128 --eval-interval 7").split(),
        *("--eval-iters 2 --log-interval 1 --distributed-backend nccl --mock-data").split(),
        "--use-megatron-fsdp",
    ]
    defaults = _defaults(given)
    flags = {option[0] for option in defaults}
    assert not flags & {
        "--use-megatron-fsdp",
        "--ckpt-format",
        "--max-position-embeddings",
        "--eval-interval",
        "--eval-iters",
        "--log-interval",
        "--distributed-backend",
        "--tokenizer-type",  # --mock-data: Megatron's data, not the embedded text
    }
    assert ("--transformer-impl", "local") in defaults


def test_opting_out_of_megatron_fsdp_drops_its_checkpoint_format_on_a_gpu():
    defaults = _defaults([*MODEL_AND_RUN_LENGTH, "--no-use-megatron-fsdp"], has_gpu=True)
    assert ("--use-megatron-fsdp",) not in defaults
    assert ("--ckpt-format", "fsdp_dtensor") not in defaults


def test_without_a_gpu_training_without_megatron_fsdp_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--no-use-megatron-fsdp without a GPU"):
        _defaults([*MODEL_AND_RUN_LENGTH, "--no-use-megatron-fsdp"])


@pytest.mark.parametrize(
    ("run_length", "eval_interval", "log_interval"),
    [
        (["--train-iters", "3"], "1", "1"),
        (["--train-iters", "200"], "50", "20"),
        (["--train-iters", "100000"], "25000", "100"),
        (["--train-samples", "800", "--global-batch-size", "8"], "25", "10"),
        ([], "1000", None),  # length unknown: Megatron's log interval stays
    ],
)
def test_evaluation_and_logging_intervals_follow_the_run_length(
    run_length, eval_interval, log_interval
):
    defaults = dict((o[0], o[1:]) for o in _defaults(["--seq-length", "64", *run_length]))
    assert defaults["--eval-interval"] == (eval_interval,)
    assert defaults.get("--log-interval") == ((log_interval,) if log_interval else None)


def test_save_gets_an_interval_of_a_quarter_run_unless_given():
    assert ("--save-interval", "10") in _defaults([*MODEL_AND_RUN_LENGTH, "--save", "ckpt"])
    given = _defaults([*MODEL_AND_RUN_LENGTH, "--save", "ckpt", "--save-interval", "5"])
    assert not [option for option in given if option[0] == "--save-interval"]
    assert not [option for option in _defaults(MODEL_AND_RUN_LENGTH) if "--save" in option[0]]


def test_a_config_that_turns_megatron_fsdp_off_opts_out(tmp_path):
    from megatron_muon.pretrain import config_flags

    config = tmp_path / "run.yaml"
    config.write_text("train:\n  use_megatron_fsdp: false\n  bf16: false\n")
    assert config_flags(config) == ["--no-use-megatron-fsdp"]


def test_the_entry_point_refuses_no_megatron_fsdp_on_cpu_before_it_starts():
    completed = subprocess.run(
        [sys.executable, "-m", "megatron_muon.pretrain", *MODEL_AND_RUN_LENGTH]
        + ["--no-use-megatron-fsdp"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 1
    assert "megatron_muon.pretrain: error: --no-use-megatron-fsdp without a GPU" in (
        completed.stderr
    )


def test_a_schedule_mismatch_on_load_is_explained_with_megatrons_two_flags():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_muon.pretrain import scheduler_mismatch_message

    class _Optimizer:
        param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    def scheduler(decay_steps: int) -> OptimizerParamScheduler:
        return OptimizerParamScheduler(
            _Optimizer(),
            init_lr=0.0,
            max_lr=0.02,
            min_lr=0.0,
            lr_warmup_steps=0,
            lr_decay_steps=decay_steps,  # --train-iters x --global-batch-size
            lr_decay_style="linear",
            start_wd=0.01,
            end_wd=0.01,
            wd_incr_steps=0,
            wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False,
        )

    saved = scheduler(320).state_dict()
    with pytest.raises(AssertionError) as error:
        scheduler(640).load_state_dict(saved)
    message = scheduler_mismatch_message(error.value)
    assert "--override-opt_param-scheduler" in message
    assert "--use-checkpoint-opt_param-scheduler" in message
    assert "--train-iters" in message and "total number of iterations" in message


def test_a_gpu_without_transformer_engine_gets_the_local_transformer_and_no_te_fusions():
    defaults = _defaults(MODEL_AND_RUN_LENGTH, has_gpu=True, has_te=False)
    assert ("--transformer-impl", "local") in defaults
    assert ("--no-gradient-accumulation-fusion",) in defaults
    assert ("--distributed-backend", "gloo") not in defaults  # NCCL stays
    assert ("--use-cpu-initialization",) not in defaults
    with_te = _defaults(MODEL_AND_RUN_LENGTH, has_gpu=True, has_te=True)
    assert not [d for d in with_te if d[0] == "--transformer-impl"]
    chosen = _defaults(
        [*MODEL_AND_RUN_LENGTH, "--transformer-impl", "transformer_engine"],
        has_gpu=True,
        has_te=False,
    )
    assert not [d for d in chosen if d[0] == "--transformer-impl"]  # the user's choice stands

"""``python -m megatron_muon.pretrain`` on 2 CPU ranks: Megatron's own loop on the embedded text.

The command gives only model and run-length flags (Megatron-FSDP, fsdp_dtensor checkpoints,
evaluation and logging intervals, the CPU flags are the entry point's defaults) and keeps
Megatron's dropout (0.1), so that a resume is exact only if the RNG state is restored: the loss
falls, progress lines, the JSON log and the plot are written; a ``--load`` of the iteration-20
checkpoint, without ``--no-load-rng``, gives the uninterrupted run's losses bit for bit; a
``--load`` with another ``--train-iters`` stops with an error naming Megatron's scheduler flags.
Faults: a NaN gradient on one rank stops the run with the weights of the last good step;
``--optimizer adam`` saves at DP=2; the Muon checkpoint loaded into an Adam run is refused.
In-process: the loss checks, the flag and config errors; ``--help`` (a subprocess, no launch).
``torchrun`` launches are the slow part (15-60 s each).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.torchrun import (
    REPO,
    MegatronRun,
    TorchrunFailure,
    parse_iteration_lines,
    run_megatron,
)

pytestmark = pytest.mark.timeout(900)

COMMAND = [
    *("--optimizer muon --num-layers 2 --hidden-size 64 --num-attention-heads 4").split(),
    *("--seq-length 64 --micro-batch-size 4 --global-batch-size 8 --train-iters 40").split(),
    *("--lr 0.02").split(),
]
ENTRY = ["-m", "megatron_muon.pretrain"]


# A tiny GPT on the embedded text, Muon on Megatron-FSDP; the config's run shape is overridden
# (command-line flags win) to stay fast.
FLAGS = [
    *("--config", str(REPO / "configs" / "tiny-cpu.yaml")),
    *("--optimizer muon --use-megatron-fsdp --ckpt-format fsdp_dtensor").split(),
    *("--data-parallel-sharding-strategy optim_grads_params").split(),
    *("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64").split(),
    *("--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8").split(),
    *("--train-iters 12 --lr 0.01 --lr-decay-style constant --log-interval 1").split(),
    *("--eval-interval 6 --eval-iters 1 --hidden-dropout 0 --attention-dropout 0").split(),
]


# Fewer iterations than the config's warm-up, no evaluation.
SHORT_RUN = ["--lr-warmup-iters", "0", "--eval-iters", "0", "--eval-interval", "1000"]


def _progress_lines(run) -> list[str]:
    return [
        line
        for text in run.rank_outputs.values()
        for line in text.splitlines()
        if line.startswith("[megatron-muon] iter ")
    ]


@pytest.fixture(scope="module")
def muon_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[MegatronRun, Path]:
    """The command's 40 iterations on 2 ranks, with --log-json, --plot and --save (every 10)."""
    pytest.importorskip("matplotlib")
    root = tmp_path_factory.mktemp("pretrain")
    run = run_megatron(
        [*COMMAND, "--log-json", str(root / "run.json"), "--plot", str(root / "loss.png")]
        + ["--save", str(root / "ckpt")],
        nproc=2,
        entry=ENTRY,
    )
    return run, root


@pytest.mark.multirank
def test_pretrain_entry_point_trains_from_model_flags_alone_and_resumes_exactly(
    muon_run: tuple[MegatronRun, Path], tmp_path: Path
) -> None:
    run, root = muon_run
    log_json, plot, checkpoints = root / "run.json", root / "loss.png", root / "ckpt"
    (applied,) = [line for line in run.rank_outputs[0].splitlines() if "defaults applied:" in line]
    assert "--use-megatron-fsdp --ckpt-format fsdp_dtensor" in applied
    assert "--eval-interval 10 --eval-iters 10 --log-interval 4 --save-interval 10" in applied
    assert not any("defaults applied:" in line for line in run.rank_outputs[1].splitlines())
    progress = _progress_lines(run)
    assert len(progress) == 10, progress  # every 4th of 40 iterations
    assert "tokens/s" in progress[-1] and "optimizer" in progress[-1]
    log = json.loads(log_json.read_text())
    losses = {record["iteration"]: record["train_loss"] for record in log["train"]}
    assert sorted(losses) == list(range(1, 41))  # every iteration, whatever --log-interval
    # Per-iteration losses are noisy (one small batch each): compare the first and last tenths.
    values = list(losses.values())
    assert sum(values[-4:]) < 0.85 * sum(values[:4]), values
    assert [r["iteration"] for r in log["valid"] if not r.get("final")] == [10, 20, 30, 40]
    assert all(0.0 < record["optimizer_share"] < 1.0 for record in log["train"])
    assert plot.stat().st_size > 0
    assert sorted(p.name for p in checkpoints.glob("iter_*")) == [
        f"iter_{i:07d}" for i in (10, 20, 30, 40)
    ]
    print(f"\npretrain entry: train loss {losses}, valid {log['valid']} ({run.wall_s:.1f} s)")

    # Resume from iteration 20 (as after an interruption there), with the same command.
    resumed_json = tmp_path / "resumed.json"
    run_megatron(
        [*COMMAND, "--log-json", str(resumed_json), "--load", str(checkpoints)]
        + ["--ckpt-step", "20"],
        nproc=2,
        entry=ENTRY,
    )
    resumed = {
        r["iteration"]: r["train_loss"] for r in json.loads(resumed_json.read_text())["train"]
    }
    assert resumed == {i: losses[i] for i in range(21, 41)}

    # Another --train-iters changes the learning-rate schedule: refused, naming the flags.
    with pytest.raises(TorchrunFailure, match="--override-opt_param-scheduler") as failure:
        run_megatron(
            [*COMMAND, "--train-iters", "60", "--load", str(checkpoints)],  # the last one wins
            nproc=2,
            entry=ENTRY,
        )
    assert "--use-checkpoint-opt_param-scheduler" in str(failure.value)


# --------------------------------------------------------------------------------------------------
# faults: a NaN gradient, Adam's lazy state, a checkpoint of another optimizer
# --------------------------------------------------------------------------------------------------


@pytest.mark.multirank
def test_a_nan_gradient_on_one_rank_skips_the_step_everywhere_and_stops_the_run() -> None:
    from tests.pretrain_fault_driver import FAULT_VARIABLE

    # Rank 1's backward of iteration 3 yields NaN gradients; its loss stays finite. Before: the
    # step ran, Muon spread NaN to every weight, the run trained to the end with NaN losses and
    # exit 0 ("number of nan iterations: 0").
    with pytest.raises(TorchrunFailure) as failure:
        run_megatron(
            [*FLAGS, *SHORT_RUN, "--train-iters", "6"],
            nproc=2,
            entry=[str(REPO / "tests" / "pretrain_fault_driver.py")],
            env={FAULT_VARIABLE: "1:3"},
            timeout=200,
        )
    text = str(failure.value)
    for rank in range(2):
        assert f"--- rank {rank} stderr.log" in text
    assert text.count("iteration 3: found nan in the global gradient norm") >= 2, text[-4000:]
    assert "the optimizer step was skipped on every rank" in text
    logged = parse_iteration_lines(text)
    assert max(logged) == 2, logged  # stopped in iteration 3, before its log line
    assert all(math.isfinite(fields["lm loss"]) for fields in logged.values()), logged


@pytest.mark.multirank
def test_adam_with_megatron_fsdp_saves_at_dp2_with_a_rank_holding_empty_shards(
    tmp_path: Path,
) -> None:
    # Stock megatron-core creates Adam's state lazily: a rank with 0 rows of a param has none,
    # and the fsdp_dtensor save hung ("Storing distributed optimizer sharded state").
    flags = [flag if flag != "muon" else "adam" for flag in FLAGS]
    run = run_megatron(
        [*flags, *SHORT_RUN, "--train-iters", "2"]
        + ["--save", str(tmp_path / "adam"), "--save-interval", "2"],
        nproc=2,
        entry=ENTRY,
        timeout=200,
    )
    assert sorted(run.iterations) == [1, 2]
    assert (tmp_path / "adam" / "iter_0000002" / ".metadata").is_file()


@pytest.mark.multirank
def test_a_muon_checkpoint_loaded_into_an_adam_run_is_refused_naming_both(
    muon_run: tuple[MegatronRun, Path],
) -> None:
    _, root = muon_run
    flags = [flag if flag != "muon" else "adam" for flag in COMMAND]
    with pytest.raises(TorchrunFailure) as failure:
        run_megatron(
            [*flags, "--load", str(root / "ckpt"), "--ckpt-step", "20"],
            nproc=2,
            entry=ENTRY,
            timeout=200,
        )
    text = str(failure.value)
    assert text.count("CheckpointMismatchError") >= 2, text[-4000:]
    assert (
        "holds optimizer state ['exp_avg', 'exp_avg_sq', 'momentum_buffer', 'step'], this run's "
        "--optimizer adam keeps ['exp_avg', 'exp_avg_sq', 'step']"
    ) in text


# --------------------------------------------------------------------------------------------------
# the DeepSeek-V3-shaped preset: MLA with q-LoRA, MoE with a shared expert, EP=2, MuonClip
# --------------------------------------------------------------------------------------------------


@pytest.mark.multirank
def test_the_tiny_deepseek_v3_preset_trains_with_muonclip_on_its_mla_heads() -> None:
    # The preset as shipped, shortened, with tau among its max logits (0.013-0.021 over these
    # iterations at tau 0.01: 9 to 12 of its 12 heads clipped) so that MuonClip acts.
    config = ["--config", str(REPO / "configs" / "tiny-deepseek-v3.yaml")]
    run = run_megatron(
        [*config, *SHORT_RUN, "--train-iters", "6", "--log-interval", "1"]
        + ["--qk-clip-threshold", "0.015"],
        nproc=2,
        entry=ENTRY,
        timeout=300,
    )
    assert sorted(run.iterations) == list(range(1, 7))
    losses = run.series("lm loss")
    assert losses[-1] < 0.85 * losses[0], losses
    output = run.rank_outputs[0]
    assert "Muon[expert]: 8 params" in output and "over expt_dp (1 rank)" in output
    assert "megatron-muon QK-clip: threshold 0.015 on 3 attention layers" in output
    clipped = [line for line in output.splitlines() if line.startswith("QK-clip: ")]
    counts = [int(line.split()[1]) for line in clipped]
    print(f"\ntiny-deepseek-v3: lm loss {losses}; QK-clip heads clipped (of 12) {counts}")
    assert counts and all(0 < count <= 12 for count in counts), clipped


def test_config_flags_turn_yaml_sections_into_megatron_flags(tmp_path: Path) -> None:
    from megatron_muon.pretrain import config_flags

    config = tmp_path / "run.yaml"
    config.write_text(
        "model:\n  name: tiny\n  num_layers: 2\n  gated_linear_unit: true\n"
        "  moe_layer_freq: [0, 1]\ntrain:\n  lr: 0.01\n  use_megatron_fsdp: true\n"
        "  bf16: false\n"
    )
    assert config_flags(config) == [
        *("--num-layers", "2", "--swiglu", "--moe-layer-freq", "[0,1]"),
        *("--lr", "0.01", "--use-megatron-fsdp"),
    ]
    config.write_text("model:\n  num_layerz: 2\n")
    with pytest.raises(ValueError, match="num_layerz"):
        config_flags(config)


def test_config_that_is_not_a_mapping_is_refused_naming_the_file(tmp_path: Path) -> None:
    from megatron_muon.pretrain import config_flags

    config = tmp_path / "list.yaml"
    config.write_text("- num_layers: 2\n- lr: 0.01\n")
    with pytest.raises(ValueError, match=r"--config .*list.yaml: expected a mapping .* got a list"):
        config_flags(config)


@pytest.mark.parametrize(
    "launch",
    [
        ["-m", "megatron_muon.pretrain"],
        # Megatron-LM's pretrain_gpt.py parses this way, after install() as its first line.
        [
            "-c",
            "from megatron_muon.integrations.megatron_lm import install; install(); "
            "from megatron.training.arguments import parse_args; parse_args()",
        ],
    ],
    ids=["entry-point", "megatron-lm-after-install"],
)
def test_help_lists_the_muon_flags_though_megatrons_help_holds_a_bare_percent(
    launch: list[str],
) -> None:
    # megatron-core 0.19.2's help of --moe-paged-stash-buffer-size-factor-cuda ends "10%)", which
    # argparse formats: stock, --help stops with "unsupported format character ')'".
    completed = subprocess.run(
        [sys.executable, *launch, "--help"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    for flag in ("--muon-fsdp-mode", "--muon-ns-method", "--muon-momentum", "--optimizer"):
        assert flag in completed.stdout
    assert "1.10 = 10%)" in " ".join(completed.stdout.split())


@pytest.mark.parametrize(
    "flags,message",
    [
        ("--muon-fsdp-bucket-size-mb 1e-9", "--muon-fsdp-bucket-size-mb must be positive"),
        ("--muon-momentum 1.5", "--muon-momentum 1.5: muon_momentum must be in [0, 1)"),
        ("--muon-num-ns-steps 0", "--muon-num-ns-steps 0: num_ns_steps must be at least 1"),
        ("--muon-coefficient-type bogus", "--muon-coefficient-type bogus: unknown"),
        ("--muon-ns-method gram --muon-gram-restarts 7", "--muon-gram-restarts [7]: gram restarts"),
    ],
)
def test_bad_muon_flag_values_are_refused_naming_the_flag(flags: str, message: str) -> None:
    from megatron_muon.fsdp.arguments import add_muon_args, check_muon_args

    args = add_muon_args(argparse.ArgumentParser()).parse_args(flags.split())
    with pytest.raises(ValueError) as error:
        check_muon_args(args)
    assert str(error.value).startswith(message), str(error.value)


def _loss_checks(rank: int, world_size: int) -> dict:
    from megatron.core.rerun_state_machine import RerunMode, initialize_rerun_state_machine
    from megatron.training.global_vars import set_args

    from megatron_muon.cli.pretrain_data import loss_func

    initialize_rerun_state_machine(mode=RerunMode.DISABLED)
    mask = torch.ones(2, 4)
    results = {}
    for check in (True, False):
        set_args(
            argparse.Namespace(check_for_nan_in_loss_and_grad=check, check_for_spiky_loss=False)
        )
        for kind, value in (("nan", float("nan")), ("inf", float("inf"))):
            output = torch.ones(2, 4)
            output[1, 2] = value
            try:
                loss_func(mask, output)
                results[(check, kind)] = None
            except RuntimeError as error:
                results[(check, kind)] = str(error)
    return results


@pytest.mark.multirank
def test_loss_function_validates_nan_and_inf_losses_as_megatron_does() -> None:
    # Megatron-LM's pretrain_gpt.py checks each rank's local loss through the rerun state machine
    # (fatal); --no-check-for-nan-in-loss-and-grad turns the check off.
    (results,) = run_on_ranks(_loss_checks, 1)
    assert "found NaN in local forward loss calculation" in results[(True, "nan")]
    assert "found Inf in local forward loss calculation" in results[(True, "inf")]
    assert results[(False, "nan")] is None and results[(False, "inf")] is None

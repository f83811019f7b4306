"""``python -m megatron_muon.pretrain`` on 2 CPU ranks: Megatron's own loop on the embedded text.

The command gives only model and run-length flags (Megatron-FSDP, fsdp_dtensor checkpoints,
evaluation and logging intervals, the CPU flags are the entry point's defaults) and keeps
Megatron's dropout (0.1), so that a resume is exact only if the RNG state is restored: the loss
falls, progress lines, the JSON log and the plot are written; a ``--load`` of the iteration-20
checkpoint, without ``--no-load-rng``, gives the uninterrupted run's losses bit for bit; a
``--load`` with another ``--train-iters`` stops with an error naming Megatron's scheduler flags.
Three ``torchrun`` launches (the slow part, 15-60 s each).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.torchrun import TorchrunFailure, run_megatron

pytestmark = pytest.mark.timeout(900)

COMMAND = [
    *("--optimizer muon --num-layers 2 --hidden-size 64 --num-attention-heads 4").split(),
    *("--seq-length 64 --micro-batch-size 4 --global-batch-size 8 --train-iters 40").split(),
    *("--lr 0.02").split(),
]
ENTRY = ["-m", "megatron_muon.pretrain"]


def _progress_lines(run) -> list[str]:
    return [
        line
        for text in run.rank_outputs.values()
        for line in text.splitlines()
        if line.startswith("[megatron-muon] iter ")
    ]


@pytest.mark.multirank
def test_pretrain_entry_point_trains_from_model_flags_alone_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    log_json, plot, checkpoints = tmp_path / "run.json", tmp_path / "loss.png", tmp_path / "ckpt"
    run = run_megatron(
        [*COMMAND, "--log-json", str(log_json), "--plot", str(plot), "--save", str(checkpoints)],
        nproc=2,
        entry=ENTRY,
    )
    (applied,) = [line for line in run.rank_outputs[0].splitlines() if "defaults applied:" in line]
    assert "--use-megatron-fsdp --ckpt-format fsdp_dtensor" in applied
    assert "--eval-interval 10 --eval-iters 10 --log-interval 4 --save-interval 10" in applied
    assert not any("defaults applied:" in line for line in run.rank_outputs[1].splitlines())
    progress = _progress_lines(run)
    assert len(progress) == 10, progress  # every 4th of 40 iterations
    assert "tokens/s" in progress[-1] and "optimizer" in progress[-1]
    log = json.loads(log_json.read_text())
    losses = {record["iteration"]: record["train_loss"] for record in log["train"]}
    assert sorted(losses) == list(range(4, 41, 4))
    # Per-iteration losses are noisy (one small batch each): compare the first and last thirds.
    values = list(losses.values())
    assert sum(values[-3:]) < 0.85 * sum(values[:3]), values
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
    assert resumed == {i: losses[i] for i in range(24, 41, 4)}

    # Another --train-iters changes the learning-rate schedule: refused, naming the flags.
    with pytest.raises(TorchrunFailure, match="--override-opt_param-scheduler") as failure:
        run_megatron(
            [*COMMAND, "--train-iters", "60", "--load", str(checkpoints)],  # the last one wins
            nproc=2,
            entry=ENTRY,
        )
    assert "--use-checkpoint-opt_param-scheduler" in str(failure.value)


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

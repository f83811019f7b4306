"""``python -m megatron_muon.pretrain`` on 2 CPU ranks: Megatron's own loop on the embedded text.

One ``torchrun`` launch (the slow part, 10-40 s): Muon on Megatron-FSDP (optim_grads_params) trains
a tiny GPT on the standard library's byte tokens; the loss falls, the progress lines, the JSON log
(train and validation records) and the plot are written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.torchrun import REPO, run_megatron

pytestmark = pytest.mark.timeout(600)


@pytest.mark.multirank
def test_pretrain_entry_point_trains_on_embedded_text_writes_its_log_and_resumes(
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    log_json, plot = tmp_path / "run.json", tmp_path / "loss.png"
    flags = [
        # The config's run shape, overridden below (command-line flags win) to stay fast.
        *("--config", str(REPO / "configs" / "tiny-cpu.yaml")),
        *("--optimizer muon --use-megatron-fsdp --ckpt-format fsdp_dtensor").split(),
        *("--data-parallel-sharding-strategy optim_grads_params").split(),
        *("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64").split(),
        *("--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8").split(),
        *("--train-iters 12 --lr 0.01 --lr-decay-style constant --log-interval 1").split(),
        *("--eval-interval 6 --eval-iters 1 --hidden-dropout 0 --attention-dropout 0").split(),
    ]
    checkpoints = tmp_path / "checkpoints"
    run = run_megatron(
        [*flags, *("--log-json", str(log_json), "--plot", str(plot))]
        + ["--save", str(checkpoints), "--save-interval", "6"],
        nproc=2,
        entry=["-m", "megatron_muon.pretrain"],
    )
    progress = [
        line
        for text in run.rank_outputs.values()
        for line in text.splitlines()
        if line.startswith("[megatron-muon] iter ")
    ]
    assert len(progress) == 12, progress
    assert "tokens/s" in progress[-1] and "optimizer" in progress[-1]
    log = json.loads(log_json.read_text())
    losses = [record["train_loss"] for record in log["train"]]
    assert [record["iteration"] for record in log["train"]] == list(range(1, 13))
    # Per-iteration losses are noisy (one small batch each): compare the first and last thirds.
    assert sum(losses[-4:]) < 0.85 * sum(losses[:4]), losses
    assert [record["iteration"] for record in log["valid"] if not record.get("final")] == [6, 12]
    assert all(0.0 < record["optimizer_share"] < 1.0 for record in log["train"])
    assert plot.stat().st_size > 0
    print(f"\npretrain entry: train loss {losses}, valid {log['valid']} ({run.wall_s:.1f} s)")

    # Save at iteration 6, resume: iterations 7-12 give the uninterrupted run's losses exactly.
    resumed_json = tmp_path / "resumed.json"
    run_megatron(
        [*flags, "--log-json", str(resumed_json)]
        + ["--load", str(checkpoints), "--ckpt-step", "6", "--no-load-rng"],
        nproc=2,
        entry=["-m", "megatron_muon.pretrain"],
    )
    resumed = json.loads(resumed_json.read_text())["train"]
    assert [record["iteration"] for record in resumed] == list(range(7, 13))
    assert [record["train_loss"] for record in resumed] == losses[6:]


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

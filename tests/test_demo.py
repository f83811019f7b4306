"""The demo's summary and plot, from run logs in the pretrain entry point's JSON format."""

from __future__ import annotations

import pytest

from megatron_muon import demo


def _record(final: float, lr: float) -> dict:
    train = [
        {
            "iteration": i,
            "lr": lr,
            "train_loss": final + 1.0 / i,
            "tokens_per_s": 1000.0 + i,
            "step_ms": 500.0,
            "optimizer_share": 0.1,
        }
        for i in (10, 20, 30)
    ]
    valid = [{"iteration": 15, "valid_loss": final + 0.2}, {"iteration": 30, "valid_loss": final}]
    return {"train": train, "valid": valid, "wall_seconds": 42.0, "lr": lr}


def test_summary_takes_final_losses_and_steady_state_throughput(tmp_path):
    runs = {"muon": _record(2.0, 0.01), "adam": _record(2.5, 0.003)}
    summary = demo._summary(runs)
    assert summary["muon"]["final_valid_loss"] == 2.0
    assert summary["adam"]["final_train_loss"] == pytest.approx(2.5 + 1 / 30)
    assert summary["muon"]["tokens_per_s"] == pytest.approx(1025.0)  # first interval left out
    demo._plot(runs, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 10_000

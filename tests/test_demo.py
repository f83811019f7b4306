"""``make demo``: its progress lines, its summary and its plot's data.

In-process: the summary's final figures and throughput, the smoothing, which lines of a run's
output the demo echoes, the plot from synthetic run logs. One short demo (12 iterations per
optimizer, 2 ranks, ~1 min): progress printed while each optimizer trains, a train loss for every
iteration in the JSON, evaluations every ``--eval-interval`` on the same held-out sequences.
"""

from __future__ import annotations

import json
import re

import pytest

from megatron_muon import demo
from megatron_muon.cli.loss_plot import final_figures, moving_average, plot_loss_curves


def _record(final: float, lr: float, iterations: int = 40) -> dict:
    train = [
        {
            "iteration": i,
            "lr": lr,
            "train_loss": final + 1.0 / i,
            "tokens_per_s": 1000.0 if i > 1 else 10.0,
            "step_ms": 500.0 if i > 1 else 5000.0,
            "optimizer_share": 0.1,
            "elapsed_s": 0.5 * i,
        }
        for i in range(1, iterations + 1)
    ]
    valid = [
        {"iteration": 20, "valid_loss": final + 0.2},
        {"iteration": 40, "valid_loss": final + 0.1},
        {"iteration": 40, "valid_loss": final + 0.1, "final": True},
    ]
    return {"train": train, "valid": valid, "wall_seconds": 42.0, "lr": lr}


def test_summary_takes_the_final_figures_and_the_median_step() -> None:
    summary = demo._summary({"muon": _record(2.0, 0.003), "adam": _record(2.5, 0.01)})
    assert summary["muon"]["final_iteration"] == 40
    assert summary["muon"]["final_valid_loss"] == pytest.approx(2.1)
    # the mean of the last 20 iterations' train losses
    expected = 2.5 + sum(1.0 / i for i in range(21, 41)) / 20
    assert summary["adam"]["final_train_loss"] == pytest.approx(expected)
    # the first step (compilation, warm-up) does not move the median
    assert summary["muon"]["step_ms"] == 500.0 and summary["muon"]["tokens_per_s"] == 1000.0


def test_moving_average_is_centred_and_shrinks_at_the_ends() -> None:
    assert moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 1) == [1.5, 2.0, 3.0, 4.0, 4.5]
    assert moving_average([3.0, 1.0], 0) == [3.0, 1.0]
    with pytest.raises(ValueError, match="half_width"):
        moving_average([1.0], -1)
    with pytest.raises(ValueError, match="no train or no validation"):
        final_figures({"train": [], "valid": []})


def test_the_demo_echoes_rank_0_progress_validation_and_data_lines_only() -> None:
    line = (
        "[megatron-muon] iter 20/200 | lr 1.0e-03 | train loss 2.5 | val loss - | "
        "5,000 tokens/s | step 300.0 ms (optimizer 10%) | elapsed 0:06, left 0:54\n"
    )
    expected = "    muon | " + line.removeprefix("[megatron-muon] ").strip()
    assert demo.echo_progress(line, "muon") == expected
    valid = "[megatron-muon] validation at iter 20: loss 2.6000\n"
    assert demo.echo_progress(valid, "adam") == "    adam | validation at iter 20: loss 2.6000"
    data = "> byte-level data: Python 3.12 standard library (497 files): ...\n"
    assert demo.echo_progress(data, "muon") == "    muon | byte-level data: Python 3.12 " + (
        "standard library (497 files): ..."
    )
    assert demo.echo_progress(" [2026-11-27] iteration 20/ 200 | lm loss: 2.5 |", "muon") is None
    assert demo.echo_progress("[megatron-muon] defaults applied: --foo", "muon") is None


def test_the_plot_is_written_for_runs_with_and_without_evaluations(tmp_path) -> None:
    runs = {"Muon": _record(2.0, 0.003), "AdamW": _record(2.5, 0.01)}
    plot_loss_curves(runs, tmp_path / "loss.png", title="t", details={"Muon": "peak lr 0.003"})
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    no_eval = {"Muon": {**_record(2.0, 0.003), "valid": []}}
    plot_loss_curves(no_eval, tmp_path / "train_only.png", title="t")
    assert (tmp_path / "train_only.png").stat().st_size > 10_000


@pytest.mark.multirank
def test_a_short_demo_prints_progress_and_logs_every_iteration_and_fixed_evaluations(
    tmp_path, capsys
) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "demo_out"
    # 12 iterations: more than the config's 10 warm-up iterations
    flags = ["--train-iters", "12", "--eval-interval", "6", "--eval-iters", "2"]
    assert demo.main(["--out", str(out), *flags, "--log-interval", "3"]) == 0
    console = capsys.readouterr().out
    for name in demo.DEMO_RUNS:
        progress = re.findall(
            rf"^ +{name} \| iter (\d+)/12 \| .*train loss [0-9.]+ .*elapsed \d+:\d\d, left "
            r"\d+:\d\d$",
            console,
            re.MULTILINE,
        )
        assert progress == ["3", "6", "9", "12"], console
        evaluations = re.findall(rf"^ +{name} \| validation at iter (\d+)", console, re.MULTILINE)
        assert evaluations == ["6", "12", "12"], console
        log = json.loads((out / f"{name}.json").read_text())
        assert [r["iteration"] for r in log["train"]] == list(range(1, 13))
        assert all(r["train_loss"] > 0 and r["step_ms"] > 0 for r in log["train"])
        assert [(r["iteration"], r.get("final", False)) for r in log["valid"]] == [
            (6, False),
            (12, False),
            (12, True),
        ]
        # the same held-out sequences every evaluation: the final one repeats the last exactly
        assert log["valid"][1]["valid_loss"] == log["valid"][2]["valid_loss"]
        assert log["valid"][1]["valid_loss"] < log["valid"][0]["valid_loss"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["muon"]["final_iteration"] == summary["adam"]["final_iteration"] == 12
    assert (out / "loss.png").stat().st_size > 10_000
    assert "Muon's final validation loss" in console
    assert "muon | byte-level data: " in console and "adam | byte-level data: " in console

"""`python -m benchmarks --quick` runs end to end and its results.json holds every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from megatron_muon.common.options import FsdpOptimizerT

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.multirank
def test_quick_benchmark_writes_every_required_figure(tmp_path):
    from benchmarks.__main__ import required_figures
    from benchmarks.section import missing_figures

    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--peers", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # about 40 s on an idle 2-core machine; much more when it is shared
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert missing_figures(results, required_figures(with_peers=True)) == []
    assert len(required_figures(with_peers=False)) >= 30
    assert sorted(results["optimizer_step"]["dense"]["by_dp"]) == ["1", "2", "4"]
    for model in ("dense", "moe"):
        by_dp = results["optimizer_step"][model]["by_dp"]
        # gather repeats every matrix's NS on every rank; owner splits it
        assert by_dp["4"]["gather"]["ns_flops_max"] > by_dp["4"]["owner"]["ns_flops_max"]
        assert by_dp["1"]["owner"]["bytes_sent_max"] == 0
    assert results["ns_methods"], "the Gram vs standard table is empty"
    # layer_sharded orthogonalizes each unsplit matrix once, duplicated on both TP ranks (the
    # quick model's 8 matrices over 4 ranks balance to 0.57).
    assert results["tp_modes"]["layer_sharded_over_duplicated_flops"] < 0.75
    assert "Muon/AdamW" in completed.stdout
    # Every optimizer of FsdpOptimizerT is timed at DP 1, 2, 4 or reported as not built.
    optimizers = results["fsdp_optimizers"]
    assert set(optimizers["by_optimizer"]) | set(optimizers["not_built"]) == set(
        get_args(FsdpOptimizerT)
    )
    assert {"muon", "adaptive_muon", "lion"} <= set(optimizers["by_optimizer"])
    for entry in optimizers["by_optimizer"].values():
        assert sorted(entry["seconds_by_dp"]) == ["1", "2", "4"]
        assert len(entry["state_bytes_dp4"]) == 4 and min(entry["state_bytes_dp4"]) > 0


def test_missing_figures_names_what_is_absent():
    from benchmarks.__main__ import required_figures
    from benchmarks.section import missing_figures

    results = {"optimizer_step": {"dense": {"by_dp": {"2": {"owner_s": 1.0}}}}}
    missing = missing_figures(results, required_figures(with_peers=False))
    assert "optimizer_step.dense.by_dp.2.gather_s" in missing
    assert "training_step.muon_step_s" in missing
    assert "optimizer_step.moe.by_dp.*.owner_s" in missing
    only = required_figures(with_peers=False, only=("fsdp_optimizers",))
    assert only and all(figure.startswith("fsdp_optimizers.") for figure in only)


def test_report_prints_help_and_a_past_runs_tables(tmp_path, capsys):
    """``python -m benchmarks.report --help`` prints its usage; given a results.json it prints the
    run's Markdown header line."""
    from benchmarks import report

    with pytest.raises(SystemExit) as exit_info:
        report.main(["--help"])
    assert exit_info.value.code == 0
    assert "results.json" in capsys.readouterr().out

    meta = {"device_name": "cpu", "date": "today", "git_commit": "abc", "torch": "2", "repeats": 3}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": {**meta, "warmup": 1, "seconds": 5.0}}))
    assert report.main([str(path)]) == 0
    assert capsys.readouterr().out.startswith("Device: cpu. Date: today. Commit abc")


def test_fsdp_optimizers_reports_an_optimizer_it_cannot_build(monkeypatch):
    """An optimizer that ours (or the stock) cannot build is listed with its error, untimed; the
    others get their ratios and verdicts (soap alone is judged on its state balance)."""
    from benchmarks import fsdp_optimizers
    from benchmarks.config import QUICK

    def fake_launch(fn, world_size, device, size, names, warmup, repeats, eager):
        ranks = []
        for rank in range(world_size):
            muon = {"seconds": 1.0 / world_size, "state_bytes": 100 + 20 * (rank == 0)}
            muon["ours_classes"] = ["ShardedMuon", "AdamW"]
            if world_size == 1:
                muon |= {"stock_seconds": 1.0, "stock_classes": ["TensorParallelMuon", "AdamW"]}
            ranks.append({"muon": muon, "soap": {"error": "ValueError: no soap"}})
        return ranks

    monkeypatch.setattr(fsdp_optimizers, "run_ranks", fake_launch)
    monkeypatch.setattr(fsdp_optimizers, "optimizer_names", lambda: ("muon", "soap"))
    section = fsdp_optimizers.fsdp_optimizers_section(QUICK.gpt, "cpu", 1, 2)
    assert section["not_built"] == {"soap": "DP=[1, 2, 4]: ValueError: no soap"}
    muon = section["by_optimizer"]["muon"]
    assert muon["ours_over_stock_dp1"] == 1.0 and muon["dp1_over_dp2"] == 2.0
    assert muon["state_max_over_mean_dp4"] == 120 / 105
    assert muon["holds"] == {"ours_over_stock_dp1": True}
    lines = "\n".join(fsdp_optimizers.format_section(section))
    assert "soap: not built, not timed (DP=[1, 2, 4]: ValueError: no soap)" in lines

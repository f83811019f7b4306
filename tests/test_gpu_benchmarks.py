"""The GPU benchmark's code path (``python -m benchmarks --device cuda``), tiny sizes, CPU ranks:
every section produces its figures, the targets are judged, the DP = 8-64 prediction is made."""

from __future__ import annotations

import pytest

from benchmarks import gpu_run, gpu_targets
from benchmarks.gpu_config import QUICK_CPU


@pytest.fixture(scope="module")
def quick_results():
    saved: list[list[str]] = []
    results = gpu_run.run(
        "cpu",
        QUICK_CPU,
        log=lambda _: None,
        on_section=lambda r: saved.append(list(r["section_seconds"])),
    )
    return {**results, "saved_after": saved}


@pytest.mark.multirank
def test_every_gpu_benchmark_section_runs_at_quick_sizes_on_cpu(quick_results):
    for section in ("matmul", "newton_schulz", "stock", "gram", "symmetric", "training", "syrk"):
        assert "error" not in quick_results[section], quick_results[section]
    assert quick_results["training"]["muon"]["ns_flops"] > 0
    symmetric = quick_results["symmetric"]
    assert {r["precision"] for r in symmetric} == {"medium", "highest"}
    assert all(r["flop_ratio"] < 1 and r["symmetric_s"] > 0 for r in symmetric)
    # The syrk NS (Triton) runs on CUDA only: on CPU the section says why it did not run.
    assert quick_results["syrk"]["rows"] == [] and quick_results["syrk"]["problem"]
    # The figures so far are handed out after every section (a run stopped from outside keeps
    # them), the syrk section, whose Triton kernels compile on first use, last.
    saved = quick_results["saved_after"]
    assert [len(names) for names in saved] == list(range(1, len(saved) + 1))
    assert saved[-1][-1] == "syrk" and len(saved) == 7


@pytest.mark.multirank
def test_gpu_targets_are_judged_and_the_prediction_covers_dp_8_to_64(quick_results):
    targets = quick_results["targets"]
    assert set(targets) == set(gpu_targets.TARGETS)
    # Peak memory is read from the CUDA allocator only: not measured on CPU.
    measured = {name for name, verdict in targets.items() if verdict["met"] is not None}
    assert measured == set(gpu_targets.TARGETS) - {"muon_over_adamw_peak_memory"}
    rows = quick_results["prediction"]["rows"]
    assert [row["dp"] for row in rows] == [1, *gpu_targets.PREDICTED_DP]
    # More ranks share the same NS work: the busiest rank's FLOPs never grow with DP.
    flops = [row["ns_flops_max"] for row in rows]
    assert flops == sorted(flops, reverse=True) and flops[-1] < flops[0]
    assert "| target | bound | measured | met |" in gpu_targets.format_markdown(quick_results)


@pytest.mark.multirank
def test_a_gpu_run_of_named_sections_runs_only_those():
    # scripts/gpu_check.sh gives the syrk section a slot of its own: --section syrk.
    results = gpu_run.run("cpu", QUICK_CPU, log=lambda _: None, only=("syrk",))
    assert list(results["section_seconds"]) == ["syrk"]
    assert results["syrk"]["rows"] == [] and results["syrk"]["problem"]


@pytest.mark.parametrize(
    ("device", "section"), [("cuda", "headline"), ("cpu", "syrk"), ("cpu", "training")]
)
def test_a_section_of_the_other_device_is_refused_by_name(device, section, capsys):
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as stopped:
        main(["--device", device, "--section", section])
    assert stopped.value.code == 2
    assert f"--section {section}: not a section of --device {device}" in capsys.readouterr().err

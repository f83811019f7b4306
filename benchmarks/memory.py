"""Section 4: memory. A training step's peak, Muon vs AdamW (``benchmarks.training_step``), and the
optimizer step's transient memory, owner vs gather (from section 1's runs).
"""

from __future__ import annotations

from benchmarks.tables import mib, table

__all__ = ["exchange_transient_section"]


def exchange_transient_section(optimizer_step: dict, device: str) -> dict:
    """Section 4b: a step's peak memory above its start, owner vs gather (from section 1's runs)."""
    by_model: dict[str, dict] = {}
    section = {
        "measure": "live tensor bytes (profiler allocation records)"
        if device == "cpu"
        else "max_memory_allocated",
        "by_model": by_model,
    }
    for name, model in optimizer_step.items():
        by_model[name] = {}
        for dp, entry in model["by_dp"].items():
            owner, gather = entry["owner"], entry["gather"]
            bucketed = entry["owner_bucketed"]
            by_model[name][dp] = {
                "owner_peak_step_bytes_max": owner["peak_step_bytes_max"],
                "gather_peak_step_bytes_max": gather["peak_step_bytes_max"],
                "owner_bucketed_peak_step_bytes_max": bucketed["peak_step_bytes_max"],
                "owner_full_matrix_bytes_max": owner["peak_full_matrix_bytes_max"],
                "gather_full_matrix_bytes_max": gather["peak_full_matrix_bytes_max"],
                "owner_bucketed_full_matrix_bytes_max": bucketed["peak_full_matrix_bytes_max"],
                "bucket_size_bytes": entry["bucket_size_bytes"],
                "gather_over_owner": gather["peak_step_bytes_max"]
                / max(1, owner["peak_step_bytes_max"]),
            }
    return section


def report_lines(results: dict) -> list[str]:
    """Section 4 in the terminal table."""
    m = results["memory"]["training_step"]
    lines = [
        f"4. Memory (per rank, max over ranks; training step: {m['measure']})",
        f"   training step peak above start-up: Muon {mib(m['muon_peak_bytes'])}, AdamW "
        f"{mib(m['adamw_peak_bytes'])}, Muon/AdamW {m['muon_over_adamw']:.3f} "
        f"(model+grads+state before the step: Muon {mib(m['muon_state_bytes'])}, "
        f"AdamW {mib(m['adamw_state_bytes'])})",
    ]
    transient = results["memory"]["exchange_transient"]
    lines.append(f"   optimizer-step transient memory: {transient['measure']}")
    for name, by_dp in transient["by_model"].items():
        for dp, e in by_dp.items():
            lines.append(
                f"   {name} DP={dp} optimizer-step transient: owner "
                f"{mib(e['owner_peak_step_bytes_max'])} (full matrices "
                f"{mib(e['owner_full_matrix_bytes_max'])}), gather "
                f"{mib(e['gather_peak_step_bytes_max'])} (full matrices "
                f"{mib(e['gather_full_matrix_bytes_max'])}), gather/owner "
                f"{e['gather_over_owner']:.2f}x; owner with {mib(e['bucket_size_bytes'])} "
                f"buckets {mib(e['owner_bucketed_peak_step_bytes_max'])} (full matrices "
                f"{mib(e['owner_bucketed_full_matrix_bytes_max'])})"
            )
    lines.append("")
    return lines


def markdown_lines(results: dict) -> list[str]:
    """Section 4 as Markdown: training-step memory, then the optimizer step's transient."""
    m = results["memory"]["training_step"]
    out = [
        f"**4. Memory** ({m['measure']} per rank, max over ranks, DP={m['dp']}; above the "
        "process's level before the model was built)",
        "",
    ]
    out += table(
        ["", "Muon", "AdamW", "Muon/AdamW"],
        [
            [
                "model + grads + optimizer state",
                mib(m["muon_state_bytes"]),
                mib(m["adamw_state_bytes"]),
                f"{m['muon_state_bytes'] / m['adamw_state_bytes']:.3f}",
            ],
            [
                "training-step peak",
                mib(m["muon_peak_bytes"]),
                mib(m["adamw_peak_bytes"]),
                f"**{m['muon_over_adamw']:.3f}**",
            ],
        ],
    )
    rows = []
    transient = results["memory"]["exchange_transient"]
    for name, by_dp in transient["by_model"].items():
        for dp, e in by_dp.items():
            rows.append(
                [
                    name,
                    dp,
                    mib(e["owner_peak_step_bytes_max"]),
                    mib(e["gather_peak_step_bytes_max"]),
                    f"{e['gather_over_owner']:.2f}x",
                    mib(e["owner_full_matrix_bytes_max"]),
                    mib(e["gather_full_matrix_bytes_max"]),
                    mib(e["owner_bucketed_peak_step_bytes_max"]),
                    mib(e["owner_bucketed_full_matrix_bytes_max"]),
                ]
            )
    bucket = next(iter(next(iter(transient["by_model"].values())).values()))["bucket_size_bytes"]
    out.append(
        f"Optimizer-step transient memory ({transient['measure']}: peak above the step's start, "
        f"max over ranks; bucketed: `bucket_size_bytes` = {mib(bucket)}):"
    )
    out.append("")
    out += table(
        [
            "model",
            "DP",
            "owner",
            "gather",
            "gather/owner",
            "full matrices held, owner",
            "gather",
            "owner, bucketed",
            "full matrices held, owner bucketed",
        ],
        rows,
    )
    return out

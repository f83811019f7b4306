"""Section 4: memory. A training step's peak, Muon vs AdamW (``benchmarks.training_step``), and the
optimizer step's transient memory, owner vs gather (from section 1's runs).
"""

from __future__ import annotations

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

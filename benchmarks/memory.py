"""Section 4: memory. A training step's peak, Muon vs AdamW, each kind in processes of its own
(``benchmarks.training_step.training_step_memory``), and the optimizer step's transient memory,
owner vs gather (from section 1's runs, ``benchmarks.owner_vs_gather``).
"""

from __future__ import annotations

from benchmarks.config import BenchConfig
from benchmarks.launcher import run_ranks
from benchmarks.section import RunContext, Section
from benchmarks.tables import mib, table
from benchmarks.training_step import training_step_memory

__all__ = ["SECTION", "exchange_transient_section", "training_memory_section"]


def training_memory_section(config: BenchConfig, device: str) -> dict:
    """Section 4a: a training step's peak memory, Muon vs AdamW (max over ranks)."""
    size, dp = config.gpt, config.train_dp
    memory = {"dp": dp, "measure": "RSS" if device == "cpu" else "max_memory_allocated"}
    for kind in ("muon", "adamw"):
        per_rank = run_ranks(training_step_memory, dp, device, size, kind)
        # Training memory: the step's peak above the process's level before the model was built.
        memory[f"{kind}_peak_bytes"] = max(r["step_peak"] - r["before_model"] for r in per_rank)
        memory[f"{kind}_state_bytes"] = max(r["before_step"] - r["before_model"] for r in per_rank)
        memory[f"{kind}_peak_absolute_bytes"] = max(r["step_peak"] for r in per_rank)
    memory["muon_over_adamw"] = memory["muon_peak_bytes"] / memory["adamw_peak_bytes"]
    return memory


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


def _run(context: RunContext, results: dict) -> dict:
    return {
        "training_step": training_memory_section(context.config, context.device),
        "exchange_transient": exchange_transient_section(results["optimizer_step"], context.device),
    }


SECTION = Section(
    key="memory",
    run=_run,
    figures=(
        "memory.training_step.muon_peak_bytes",
        "memory.training_step.adamw_peak_bytes",
        "memory.training_step.muon_over_adamw",
        "memory.exchange_transient.measure",
        *(
            f"memory.exchange_transient.by_model.*.*.{figure}"
            for figure in (
                "owner_peak_step_bytes_max",
                "gather_peak_step_bytes_max",
                "owner_full_matrix_bytes_max",
                "gather_full_matrix_bytes_max",
                "gather_over_owner",
                "owner_bucketed_peak_step_bytes_max",
            )
        ),
    ),
    report=report_lines,
    markdown=markdown_lines,
)

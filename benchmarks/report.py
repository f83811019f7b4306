"""How a benchmark run is shown: terminal table and Markdown (its figures: ``benchmarks.figures``).

``python -m benchmarks.report [bench_out/results.json]`` prints the Markdown tables that
``docs/benchmarks.md`` records.
"""

from __future__ import annotations

import json
import sys

from benchmarks.buckets import format_buckets
from benchmarks.figures import PEERS_FIGURES, REQUIRED_FIGURES, missing_figures
from benchmarks.headline import format_headline
from benchmarks.ns_batching import format_batching

__all__ = [
    "PEERS_FIGURES",
    "REQUIRED_FIGURES",
    "format_markdown",
    "format_report",
    "missing_figures",
]


def _mb(value: float) -> str:
    return f"{value / 2**20:.1f} MiB"


def _gflop(value: float) -> str:
    return f"{value / 1e9:.1f}"


def format_report(results: dict) -> str:
    lines = []
    meta = results["meta"]
    lines.append(
        f"megatron-muon benchmarks: {meta['device_name']}, {meta['date']}, "
        f"{'quick' if meta['quick'] else 'full'} run, {meta['seconds']:.0f} s"
    )
    lines.append("")
    lines += format_headline(results["headline"])
    lines.append("")
    if "buckets" in results:
        lines += [*format_buckets(results["buckets"]), ""]
    lines.append("1. Muon optimizer step, owner vs gather (median s; per-rank NS GFLOP, MiB sent)")
    header = (
        f"{'model':>6} {'DP':>3} {'owner s':>9} {'gather s':>9} {'g/o':>6} "
        f"{'NS GF max/mean (owner)':>23} {'NS GF (gather)':>15} "
        f"{'sent MiB max/mean (owner)':>26} {'sent MiB (gather)':>18}"
    )
    lines.append(header)
    for name, model in results["optimizer_step"].items():
        for dp, e in model["by_dp"].items():
            o, g = e["owner"], e["gather"]
            lines.append(
                f"{name:>6} {dp:>3} {e['owner_s']:>9.3f} {e['gather_s']:>9.3f} "
                f"{e['gather_over_owner']:>5.2f}x "
                f"{_gflop(o['ns_flops_max']) + ' / ' + _gflop(o['ns_flops_mean']):>23} "
                f"{_gflop(g['ns_flops_max']):>15} "
                f"{o['bytes_sent_max'] / 2**20:>12.1f} / {o['bytes_sent_mean'] / 2**20:<11.1f} "
                f"{g['bytes_sent_max'] / 2**20:>18.1f}"
            )
    for name, model in results["optimizer_step"].items():
        lines.append(f"   {name}: {model['model']} ({model['num_matrices']} Muon matrices)")
    lines.append("")
    t = results["training_step"]
    lines.append(
        f"2. Training step, Muon vs AdamW (GPTModel, Megatron-FSDP {t['strategy']}, DP={t['dp']}, "
        f"{t['tokens_per_rank']} tokens/rank)"
    )
    lines.append(
        f"   whole step: Muon {t['muon_step_s']:.3f} s, AdamW {t['adamw_step_s']:.3f} s, "
        f"Muon/AdamW {t['muon_over_adamw_step']:.2f}x"
    )
    lines.append(
        f"   optimizer step: Muon {t['muon_optimizer_s']:.3f} s, AdamW "
        f"{t['adamw_optimizer_s']:.3f} s, Muon/AdamW {t['muon_over_adamw_optimizer']:.2f}x"
    )
    lines.append(f"   anchor: {t['anchor']}")
    lines.append("")
    s = results["stock_comparison"]
    lines.append(f"3. Muon step on full params, DP=1 ({s['model']})")
    lines.append(
        f"   ours {s['ours_s']:.3f} s, megatron-core TensorParallelMuon "
        f"{s['tensor_parallel_muon_s']:.3f} s ({s['tensor_parallel_muon_over_ours']:.2f}x ours), "
        f"emerging-optimizers Muon {s['emerging_muon_s']:.3f} s "
        f"({s['emerging_muon_over_ours']:.2f}x ours)"
    )
    lines.append("")
    m = results["memory"]["training_step"]
    lines.append(f"4. Memory (per rank, max over ranks; training step: {m['measure']})")
    lines.append(
        f"   training step peak above start-up: Muon {_mb(m['muon_peak_bytes'])}, AdamW "
        f"{_mb(m['adamw_peak_bytes'])}, Muon/AdamW {m['muon_over_adamw']:.3f} "
        f"(model+grads+state before the step: Muon {_mb(m['muon_state_bytes'])}, "
        f"AdamW {_mb(m['adamw_state_bytes'])})"
    )
    transient = results["memory"]["exchange_transient"]
    lines.append(f"   optimizer-step transient memory: {transient['measure']}")
    for name, by_dp in transient["by_model"].items():
        for dp, e in by_dp.items():
            lines.append(
                f"   {name} DP={dp} optimizer-step transient: owner "
                f"{_mb(e['owner_peak_step_bytes_max'])} (full matrices "
                f"{_mb(e['owner_full_matrix_bytes_max'])}), gather "
                f"{_mb(e['gather_peak_step_bytes_max'])} (full matrices "
                f"{_mb(e['gather_full_matrix_bytes_max'])}), gather/owner "
                f"{e['gather_over_owner']:.2f}x; owner with {_mb(e['bucket_size_bytes'])} "
                f"buckets {_mb(e['owner_bucketed_peak_step_bytes_max'])} (full matrices "
                f"{_mb(e['owner_bucketed_full_matrix_bytes_max'])})"
            )
    lines.append("")
    sc = results["scaling"]
    lines.append(f"5. Owner-mode step vs hidden size (DP={sc['dp']}, {sc['model']})")
    for h, sec in zip(sc["hidden"], sc["seconds"], strict=True):
        lines.append(f"   hidden {h:>5}: {sec:.4f} s")
    lines.append(
        f"   growth exponent: {sc['growth_exponent']:.2f} over all sizes, "
        f"{sc['growth_exponent_last_two']:.2f} over the last two (NS FLOPs grow as "
        f"hidden^{sc['ns_flops_exponent']:.2f})"
    )
    peak = results["matmul_peak"]
    lines.append("")
    lines.append(
        f"NS rate: measured {peak['dtype']} matmul {peak['flops_per_s'] / 1e12:.3f} TFLOP/s "
        "per rank "
        f"({peak['size']}^3); owner-mode NS TFLOP/s per rank (dense, incl. communication): "
        + ", ".join(
            f"DP={dp} {e['ns_flops_per_s_per_rank'] / 1e12:.3f}"
            for dp, e in results["optimizer_step"]["dense"]["by_dp"].items()
        )
    )
    lines.append("6. Gram vs standard NS: the benchmarks.ns_methods table above")
    lines += format_batching(results["ns_batching"])
    lines.append(f"results: {meta['results_path']}")
    return "\n".join(lines)


def _row(cells: list[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows), ""]


def _ns_cell(column: str, value: object) -> str:
    if isinstance(value, float) and column.endswith("_s"):
        return f"{value * 1e3:.2f}"
    if isinstance(value, float):
        return f"{value:.2f}x" if "speedup" in column or "ratio" in column else f"{value:.3g}"
    if isinstance(value, list):
        return str(tuple(value))
    return str(value)


def format_markdown(results: dict) -> str:
    """The run as Markdown tables (what docs/benchmarks.md records)."""
    meta = results["meta"]
    out = [
        f"Device: {meta['device_name']}. Date: {meta['date']}. Commit {meta['git_commit']}, "
        f"torch {meta['torch']}. Median of {meta['repeats']} steps after {meta['warmup']} "
        f"warm-up; the whole run took {meta['seconds']:.0f} s.",
        "",
        *format_headline(results["headline"]),
        "",
        *(format_buckets(results["buckets"]) + [""] if "buckets" in results else []),
        "**1. Muon optimizer step, owner vs gather** (per-rank NS GFLOP and MiB sent: max / mean "
        "over ranks)",
        "",
    ]
    rows = []
    for name, model in results["optimizer_step"].items():
        for dp, e in model["by_dp"].items():
            o, g = e["owner"], e["gather"]
            rows.append(
                [
                    name,
                    dp,
                    f"{e['owner_s']:.3f}",
                    f"{e['gather_s']:.3f}",
                    f"**{e['gather_over_owner']:.2f}x**",
                    f"{_gflop(o['ns_flops_max'])} / {_gflop(o['ns_flops_mean'])}",
                    f"{_gflop(g['ns_flops_max'])}",
                    f"{o['bytes_sent_max'] / 2**20:.1f} / {o['bytes_sent_mean'] / 2**20:.1f}",
                    f"{g['bytes_sent_max'] / 2**20:.1f}",
                ]
            )
    out += _table(
        [
            "model",
            "DP",
            "owner s",
            "gather s",
            "gather/owner",
            "NS GFLOP owner",
            "NS GFLOP gather",
            "MiB sent owner",
            "MiB sent gather",
        ],
        rows,
    )
    for name, model in results["optimizer_step"].items():
        out.append(f"- {name}: {model['model']} ({model['num_matrices']} Muon matrices)")
    out.append("")
    t = results["training_step"]
    out.append(
        f"**2. Training step, Muon vs AdamW** (GPTModel {t['model']['num_layers']} layers, "
        f"hidden {t['model']['hidden']}, FFN {t['model']['ffn_hidden']}, "
        f"vocab {t['model']['vocab_size']}; "
        f"Megatron-FSDP {t['strategy']}, DP={t['dp']}, {t['tokens_per_rank']} tokens per rank)"
    )
    out.append("")
    out += _table(
        ["", "Muon s", "AdamW s", "Muon/AdamW"],
        [
            [
                "whole step",
                f"{t['muon_step_s']:.3f}",
                f"{t['adamw_step_s']:.3f}",
                f"**{t['muon_over_adamw_step']:.2f}x**",
            ],
            [
                "optimizer step",
                f"{t['muon_optimizer_s']:.3f}",
                f"{t['adamw_optimizer_s']:.3f}",
                f"**{t['muon_over_adamw_optimizer']:.2f}x**",
            ],
        ],
    )
    s = results["stock_comparison"]
    out.append(f"**3. Muon step on full params, DP=1** ({s['model']})")
    out.append("")
    out += _table(
        ["implementation", "step s", "time / ours"],
        [
            ["megatron-muon ShardedMuon", f"{s['ours_s']:.3f}", "1.00x"],
            [
                "megatron-core TensorParallelMuon",
                f"{s['tensor_parallel_muon_s']:.3f}",
                f"{s['tensor_parallel_muon_over_ours']:.2f}x",
            ],
            [
                "emerging-optimizers Muon",
                f"{s['emerging_muon_s']:.3f}",
                f"{s['emerging_muon_over_ours']:.2f}x",
            ],
        ],
    )
    m = results["memory"]["training_step"]
    out.append(
        f"**4. Memory** ({m['measure']} per rank, max over ranks, DP={m['dp']}; above the "
        "process's level before the model was built)"
    )
    out.append("")
    out += _table(
        ["", "Muon", "AdamW", "Muon/AdamW"],
        [
            [
                "model + grads + optimizer state",
                _mb(m["muon_state_bytes"]),
                _mb(m["adamw_state_bytes"]),
                f"{m['muon_state_bytes'] / m['adamw_state_bytes']:.3f}",
            ],
            [
                "training-step peak",
                _mb(m["muon_peak_bytes"]),
                _mb(m["adamw_peak_bytes"]),
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
                    _mb(e["owner_peak_step_bytes_max"]),
                    _mb(e["gather_peak_step_bytes_max"]),
                    f"{e['gather_over_owner']:.2f}x",
                    _mb(e["owner_full_matrix_bytes_max"]),
                    _mb(e["gather_full_matrix_bytes_max"]),
                    _mb(e["owner_bucketed_peak_step_bytes_max"]),
                    _mb(e["owner_bucketed_full_matrix_bytes_max"]),
                ]
            )
    bucket = next(iter(next(iter(transient["by_model"].values())).values()))["bucket_size_bytes"]
    out.append(
        f"Optimizer-step transient memory ({transient['measure']}: peak above the step's start, "
        f"max over ranks; bucketed: `bucket_size_bytes` = {_mb(bucket)}):"
    )
    out.append("")
    out += _table(
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
    sc = results["scaling"]
    out.append(f"**5. Owner-mode step vs hidden size** (DP={sc['dp']}, {sc['model']})")
    out.append("")
    out += _table(
        ["hidden", "step s", "NS GFLOP (all ranks)"],
        [
            [h, f"{sec:.4f}", _gflop(fl)]
            for h, sec, fl in zip(sc["hidden"], sc["seconds"], sc["ns_flops_total"], strict=True)
        ],
    )
    out.append(
        f"Growth exponent (time ~ hidden^k): k = {sc['growth_exponent']:.2f} over all sizes, "
        f"{sc['growth_exponent_last_two']:.2f} over the last two; NS FLOPs grow as "
        f"hidden^{sc['ns_flops_exponent']:.2f}."
    )
    out.append("")
    peak = results["matmul_peak"]
    dense = results["optimizer_step"]["dense"]["by_dp"]
    out.append(
        f"NS rate: measured {peak['dtype']} matmul {peak['flops_per_s'] / 1e12:.3f} TFLOP/s "
        "per rank "
        f"({peak['size']}^3); owner-mode NS TFLOP/s per rank, dense model, communication "
        "included: "
        + ", ".join(
            f"DP={dp} {e['ns_flops_per_s_per_rank'] / 1e12:.3f} "
            f"({e['ns_flops_per_s_per_rank'] / peak['flops_per_s']:.0%} of the matmul rate)"
            for dp, e in dense.items()
        )
        + "."
    )
    out.append("")
    out.append("**6. Gram vs standard Newton-Schulz** (`benchmarks.ns_methods`, one thread)")
    out.append("")
    # Columns as benchmarks.ns_methods writes them (its own module owns their meaning).
    timings = results["ns_methods"]
    columns = list(timings[0]) if timings else []
    out += _table(
        [c.removesuffix("_s") + " ms" if c.endswith("_s") else c for c in columns],
        [[_ns_cell(column, t[column]) for column in columns] for t in timings],
    )
    out += [*format_batching(results["ns_batching"]), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = args[0] if args else "bench_out/results.json"
    with open(path) as f:
        print(format_markdown(json.load(f)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

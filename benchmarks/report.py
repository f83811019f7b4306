"""How a benchmark run is shown: terminal table and Markdown (its figures: ``benchmarks.figures``).

``python -m benchmarks.report [bench_out/results.json]`` prints the Markdown tables that
``docs/benchmarks.md`` records.
"""

from __future__ import annotations

import json
import sys

from benchmarks import (
    memory,
    ns_methods,
    owner_vs_gather,
    scaling,
    stock_comparison,
    training_step,
)
from benchmarks.buckets import format_buckets
from benchmarks.figures import PEERS_FIGURES, REQUIRED_FIGURES, missing_figures
from benchmarks.headline import format_headline, ns_rate_markdown_lines, ns_rate_report_lines
from benchmarks.ns_batching import format_batching

__all__ = [
    "PEERS_FIGURES",
    "REQUIRED_FIGURES",
    "format_markdown",
    "format_report",
    "missing_figures",
]


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
    lines += owner_vs_gather.report_lines(results)
    lines += training_step.report_lines(results)
    lines += stock_comparison.report_lines(results)
    lines += memory.report_lines(results)
    lines += scaling.report_lines(results)
    lines += ns_rate_report_lines(results)
    lines += ns_methods.report_lines(results)
    lines += format_batching(results["ns_batching"])
    lines.append(f"results: {meta['results_path']}")
    return "\n".join(lines)


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
    ]
    out += owner_vs_gather.markdown_lines(results)
    out += training_step.markdown_lines(results)
    out += stock_comparison.markdown_lines(results)
    out += memory.markdown_lines(results)
    out += scaling.markdown_lines(results)
    out += ns_rate_markdown_lines(results)
    out += ns_methods.markdown_lines(results)
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

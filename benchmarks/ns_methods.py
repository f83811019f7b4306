"""Micro-benchmark: Gram vs standard Newton-Schulz time by aspect ratio, on CPU, one thread.

For each shape ``(k, ratio * k)`` (and a batched 3-D expert stack), times
``megatron_muon.newton_schulz.methods.orthogonalize`` with ``ns_method="standard"`` and ``"gram"``
(same
coefficients, default restarts), reports the median of ``repeats`` timed calls after ``warmup``
untimed ones (the two methods timed alternately), the speedup standard/gram, and the FLOP ratio
``ns_flops`` predicts. Ratio 1 shows the fallback (Gram runs standard NS on near-square matrices).

Precisions: ``fp32`` (matmul precision ``"highest"``) compares both methods at the same precision.
``--precisions bf16 fp16`` times the ``"medium"`` paths: standard NS in bf16 against Gram NS in
bf16 (row ``bf16``, same precision, restart every 2 steps) and in fp16 (row ``fp16``, one restart
per 3 steps). Most CPUs emulate fp16 GEMMs (~100x slower): that row measures the CPU, not Gram NS.

Usage: ``python -m benchmarks.ns_methods [--k 256] [--ratios 1 4 8] [--precisions fp32 bf16]
[--json PATH]``;
``main(argv)`` is what ``make bench`` calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from benchmarks.config import BenchConfig
from benchmarks.measure import interleaved_times
from benchmarks.section import RunContext, Section
from benchmarks.tables import table
from megatron_muon.newton_schulz.methods import NSConfig, orthogonalize, uses_gram

PrecisionT = Literal["fp32", "fp16", "bf16"]


@dataclass(frozen=True, slots=True)
class NSTiming:
    """One shape at one precision: median seconds of each method and the speedup."""

    shape: tuple[int, ...]
    precision: PrecisionT
    coefficient_type: str
    standard_s: float
    gram_s: float
    speedup: float
    best_speedup: float
    flop_ratio: float
    gram_ran: bool


def time_shape(
    shape: tuple[int, ...],
    precision: PrecisionT = "fp32",
    coefficient_type: str = "quintic",
    num_ns_steps: int = 5,
    warmup: int = 2,
    repeats: int = 7,
    device: str = "cpu",
) -> NSTiming:
    """Median time of standard and Gram NS on one random fp32 ``(M, N)`` or ``(B, M, N)`` input
    on ``device`` (a GPU is synchronized around each call).

    ``precision``: ``"fp32"``: both in fp32 (matmul precision ``"highest"``). ``"fp16"`` /
    ``"bf16"``: matmul precision ``"medium"``, standard NS in bf16 and Gram NS in that
    ``gram_half_dtype`` (with its default restarts).
    """
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(device)
    rows, cols = shape[-2], shape[-1]
    standard = NSConfig(num_ns_steps=num_ns_steps, coefficient_type=coefficient_type)  # type: ignore[arg-type]
    gram = NSConfig(
        num_ns_steps=num_ns_steps,
        coefficient_type=coefficient_type,  # type: ignore[arg-type]
        ns_method="gram",
        gram_half_dtype="bfloat16" if precision == "bf16" else "float16",
    )
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest" if precision == "fp32" else "medium")
    try:
        standard_times, gram_times = interleaved_times(
            [lambda: orthogonalize(x, standard), lambda: orthogonalize(x, gram)],
            warmup,
            repeats,
            device,
        )
    finally:
        torch.set_float32_matmul_precision(previous)
    return NSTiming(
        shape=tuple(shape),
        precision=precision,
        coefficient_type=coefficient_type,
        standard_s=statistics.median(standard_times),
        gram_s=statistics.median(gram_times),
        speedup=statistics.median(standard_times) / statistics.median(gram_times),
        best_speedup=min(standard_times) / min(gram_times),
        flop_ratio=standard.flops(rows, cols) / gram.flops(rows, cols),
        gram_ran=uses_gram(rows, cols, gram),
    )


def run(
    k: int = 256,
    ratios: Sequence[int] = (1, 4, 8),
    precisions: Sequence[PrecisionT] = ("fp32",),
    num_experts: int = 4,
    warmup: int = 2,
    repeats: int = 7,
) -> list[NSTiming]:
    """Times ``(k, r k)`` for each ratio ``r``, then a ``(num_experts, k / 2, 4 k)`` expert stack.

    Runs on one CPU thread (restored afterwards) so timings compare FLOPs, not thread scaling.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    shapes: list[tuple[int, ...]] = [(k, r * k) for r in ratios]
    if num_experts > 0:
        shapes.append((num_experts, k // 2, 4 * k))
    try:
        return [
            time_shape(shape, precision, warmup=warmup, repeats=repeats)
            for precision in precisions
            for shape in shapes
        ]
    finally:
        torch.set_num_threads(threads)


def format_table(timings: Sequence[NSTiming]) -> str:
    """Plain-text table, one row per timing: medians, speedup of medians and of the fastest
    calls ("best", the least disturbed by other load), and the FLOP ratio."""
    lines = [
        f"{'shape':>18} {'precision':>9} {'standard ms':>12} {'gram ms':>9} {'speedup':>8} "
        f"{'(best)':>7} {'FLOP ratio':>10}  gram ran",
    ]
    for t in timings:
        lines.append(
            f"{str(t.shape):>18} {t.precision:>9} {t.standard_s * 1e3:>12.2f} "
            f"{t.gram_s * 1e3:>9.2f} {t.speedup:>7.2f}x {t.best_speedup:>6.2f}x "
            f"{t.flop_ratio:>9.2f}x  {t.gram_ran}"
        )
    return "\n".join(lines)


def ns_methods_section(config: BenchConfig, out_dir: Path) -> list:
    """Section 6: Gram vs standard NS, by ``benchmarks.ns_methods`` (its table is printed too)."""
    path = out_dir / "ns_methods.json"
    status = main([*config.ns_methods_argv, "--json", str(path)])
    if status != 0:
        raise RuntimeError(f"benchmarks.ns_methods exited with status {status}")
    return json.loads(path.read_text())


def _ns_cell(column: str, value: object) -> str:
    if isinstance(value, float) and column.endswith("_s"):
        return f"{value * 1e3:.2f}"
    if isinstance(value, float):
        return f"{value:.2f}x" if "speedup" in column or "ratio" in column else f"{value:.3g}"
    if isinstance(value, list):
        return str(tuple(value))
    return str(value)


def report_lines(results: dict) -> list[str]:
    """Section 6 in the terminal table: a pointer to the table the run printed."""
    return ["6. Gram vs standard NS: the benchmarks.ns_methods table above"]


def markdown_lines(results: dict) -> list[str]:
    """Section 6 as Markdown."""
    out = ["**6. Gram vs standard Newton-Schulz** (`benchmarks.ns_methods`, one thread)", ""]
    # Columns as benchmarks.ns_methods writes them (its own module owns their meaning).
    timings = results["ns_methods"]
    columns = list(timings[0]) if timings else []
    out += table(
        [c.removesuffix("_s") + " ms" if c.endswith("_s") else c for c in columns],
        [[_ns_cell(column, t[column]) for column in columns] for t in timings],
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: prints the table; ``--json PATH`` also writes the timings as JSON."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ns_methods", description=__doc__)
    parser.add_argument("--k", type=int, default=256, help="short side of each matrix")
    parser.add_argument("--ratios", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--experts", type=int, default=4, help="3-D stack size (0: none)")
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=["fp32", "bf16", "fp16"],
        default=["fp32"],
        help="fp32: both methods in fp32; bf16 / fp16: 'medium' precision, standard NS in bf16, "
        "Gram NS in bf16 / fp16",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None, help="write timings to this JSON file")
    args = parser.parse_args(argv)
    timings = run(args.k, args.ratios, args.precisions, args.experts, args.warmup, args.repeats)
    print("Newton-Schulz: Gram vs standard, 5 quintic steps, CPU, 1 thread, median of repeats")
    print(format_table(timings))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(t) for t in timings], f, indent=2)
    return 0


def _run(context: RunContext, results: dict) -> list:
    return ns_methods_section(context.config, context.out_dir)


SECTION = Section(
    key="ns_methods",
    run=_run,
    figures=("ns_methods",),
    report=report_lines,
    markdown=markdown_lines,
)


if __name__ == "__main__":
    raise SystemExit(main())

"""Batched against one-by-one Newton-Schulz, per matrix shape: where batching same-shape NS pays.

``python -m benchmarks.ns_batching [--quick]``: for each shape, ``B`` same-shape fp32 matrices
orthogonalized (Megatron's settings: 5 quintic steps; the run's NS precision, bf16 matmuls
unless ``benchmarks.machine`` chose fp32) in one batched call
(``orthogonalize_batch``: a stacking copy, then batched matmuls) and one by one (2-D calls, no
copy), in turn, best of ``repeats``, one thread. ``ns_runner.batch_pays`` batches on CPU only the
shapes at or below ``CPU_BATCH_MAX_NUMEL`` elements; the table shows where that bound comes from.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.section import RunContext, Section

__all__ = ["SECTION", "SHAPES", "batching_rows", "format_batching", "main"]

# (rows, cols, batch): the dense and MoE benchmark models' Muon matrices, and smaller ones.
SHAPES = (
    (8, 512, 4),
    (64, 64, 8),
    (64, 256, 8),
    (128, 512, 8),
    (256, 512, 8),
    (512, 256, 8),
    (512, 512, 8),
    (1536, 512, 4),
    (2048, 512, 4),
    (512, 2048, 4),
)
QUICK_SHAPES = ((64, 64, 4), (64, 256, 4), (512, 256, 2))


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def batching_rows(shapes=SHAPES, repeats: int = 3) -> list[dict]:
    """Best seconds of the batched and one-by-one NS of each ``(rows, cols, batch)``."""
    from benchmarks.optimizer_step import MUON_KWARGS
    from megatron_muon.engine.ns_runner import batch_pays
    from megatron_muon.newton_schulz.methods import (
        NSConfig,
        orthogonalize_batch,
        scaled_orthogonalize,
    )

    torch.set_num_threads(1)
    config = NSConfig(num_ns_steps=5, coefficient_type="quintic", scale_mode="spectral")
    generator = torch.Generator().manual_seed(0)
    rows_out = []
    previous = torch.get_float32_matmul_precision()
    # The run's NS precision (benchmarks.machine): bf16 matmuls where the CPU has bf16 instructions.
    torch.set_float32_matmul_precision(MUON_KWARGS["fp32_matmul_prec"])
    try:
        for rows, cols, batch in shapes:
            matrices = [torch.randn(rows, cols, generator=generator) for _ in range(batch)]

            def batched(matrices=matrices):
                return orthogonalize_batch(matrices, config)

            def one_by_one(matrices=matrices):
                return [scaled_orthogonalize(m, config) for m in matrices]

            batched(), one_by_one()  # warm-up
            batched_s, one_s = [], []
            for _ in range(repeats):  # in turn, so that load hits both alike
                batched_s.append(_best(batched, 1))
                one_s.append(_best(one_by_one, 1))
            rows_out.append(
                {
                    "shape": [rows, cols],
                    "batch": batch,
                    "batched_s": min(batched_s),
                    "one_by_one_s": min(one_s),
                    "one_by_one_over_batched": min(one_s) / min(batched_s),
                    "batched_on_cpu": batch_pays((rows, cols), torch.device("cpu")),
                }
            )
    finally:
        torch.set_float32_matmul_precision(previous)
    return rows_out


def format_batching(rows: list[dict]) -> list[str]:
    """The rows as Markdown lines."""
    lines = [
        "**Batched vs one-by-one Newton-Schulz** (one thread, the run's NS precision, best of the "
        "runs; "
        "above 1 batching pays)",
        "",
        "| shape | batch | batched ms | one by one ms | one by one / batched | batched by "
        "ShardedMuon on CPU |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {tuple(r['shape'])} | {r['batch']} | {r['batched_s'] * 1e3:.2f} | "
            f"{r['one_by_one_s'] * 1e3:.2f} | {r['one_by_one_over_batched']:.2f} | "
            f"{'yes' if r['batched_on_cpu'] else 'no'} |"
        )
    return lines


def _run(context: RunContext, results: dict) -> list[dict]:
    return batching_rows(QUICK_SHAPES if context.quick else SHAPES)


SECTION = Section(
    key="ns_batching",
    run=_run,
    figures=("ns_batching",),
    report=lambda results: format_batching(results["ns_batching"]),
    markdown=lambda results: [*format_batching(results["ns_batching"]), ""],
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ns_batching", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="three small shapes")
    args = parser.parse_args(argv)
    print("\n".join(format_batching(batching_rows(QUICK_SHAPES if args.quick else SHAPES))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

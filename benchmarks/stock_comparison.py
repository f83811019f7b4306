"""Section 3: our Muon step against megatron-core ``TensorParallelMuon`` and emerging-optimizers
``Muon`` on the same full params, one rank (measured in the headline's repetitions).
"""

from __future__ import annotations

import torch

from benchmarks.config import BenchConfig
from benchmarks.models import TransformerShapes
from benchmarks.optimizer_step import MUON_KWARGS, time_alternating
from benchmarks.section import RunContext, Section
from benchmarks.tables import table

__all__ = ["SECTION", "stock_comparison", "stock_section"]


def stock_comparison(
    rank: int, world_size: int, device: str, shapes: TransformerShapes, warmup: int, repeats: int
) -> dict:
    """ShardedMuon vs megatron-core TensorParallelMuon vs emerging-optimizers Muon, full params.

    One rank (``world_size == 1``); each optimizer has its own copy of the same params and grads.
    """
    from emerging_optimizers.orthogonalized_optimizers.muon import Muon
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from megatron_muon import ShardedMuon

    if world_size != 1:
        raise ValueError(f"the stock comparison runs on one rank, got {world_size}")
    generator = torch.Generator().manual_seed(0)
    fulls = [torch.randn(*shape, generator=generator).to(device) for shape in shapes.shapes()]
    grads = [torch.randn(*shape, generator=generator).to(device) for shape in shapes.shapes()]

    def copies() -> list[torch.nn.Parameter]:
        params = [torch.nn.Parameter(f.clone()) for f in fulls]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        return params

    emerging_kwargs = {k: v for k, v in MUON_KWARGS.items() if k != "tp_mode"}
    optimizers = {
        "ours": ShardedMuon.from_keywords(copies(), **MUON_KWARGS),
        "tensor_parallel_muon": TensorParallelMuon(copies(), **MUON_KWARGS),
        "emerging_muon": Muon(copies(), **emerging_kwargs),
    }
    return {"seconds": time_alternating(optimizers, device, warmup, repeats)}


def stock_section(config: BenchConfig, headline: dict) -> dict:
    """Section 3: ours vs TensorParallelMuon vs emerging-optimizers Muon on full params, DP = 1:
    the headline repetition whose ours/TensorParallelMuon ratio is the median."""
    reps = sorted(
        headline["repetitions"], key=lambda r: r["ratios"]["ours_over_tensor_parallel_muon"]
    )
    seconds = reps[len(reps) // 2]["stock_s"]
    return {
        "model": config.dense.describe(),
        "ours_s": seconds["ours"],
        "tensor_parallel_muon_s": seconds["tensor_parallel_muon"],
        "emerging_muon_s": seconds["emerging_muon"],
        "tensor_parallel_muon_over_ours": seconds["tensor_parallel_muon"] / seconds["ours"],
        "emerging_muon_over_ours": seconds["emerging_muon"] / seconds["ours"],
    }


def report_lines(results: dict) -> list[str]:
    """Section 3 in the terminal table."""
    s = results["stock_comparison"]
    return [
        f"3. Muon step on full params, DP=1 ({s['model']})",
        f"   ours {s['ours_s']:.3f} s, megatron-core TensorParallelMuon "
        f"{s['tensor_parallel_muon_s']:.3f} s ({s['tensor_parallel_muon_over_ours']:.2f}x ours), "
        f"emerging-optimizers Muon {s['emerging_muon_s']:.3f} s "
        f"({s['emerging_muon_over_ours']:.2f}x ours)",
        "",
    ]


def markdown_lines(results: dict) -> list[str]:
    """Section 3 as Markdown."""
    s = results["stock_comparison"]
    out = [f"**3. Muon step on full params, DP=1** ({s['model']})", ""]
    out += table(
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
    return out


def _run(context: RunContext, results: dict) -> dict:
    return stock_section(context.config, results["headline"])


SECTION = Section(
    key="stock_comparison",
    run=_run,
    figures=tuple(
        f"stock_comparison.{figure}"
        for figure in (
            "ours_s",
            "tensor_parallel_muon_s",
            "emerging_muon_s",
            "tensor_parallel_muon_over_ours",
            "emerging_muon_over_ours",
        )
    ),
    report=report_lines,
    markdown=markdown_lines,
    derived=True,
)

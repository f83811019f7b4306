"""The whole training step, Muon over AdamW, next to its ideal ratio, as tokens per step grow.

Muon's extra work over AdamW is Newton-Schulz; everything else in a step (forward, backward, the
gradient exchange, the elementwise update) costs about the same for both. So the best a Muon step
can do against an AdamW step on the same model and tokens is

    ideal = 1 + (NS FLOPs on the busiest rank) / (that rank's forward + backward FLOPs),

which tends to 1 as tokens per step grow (forward+backward grows with tokens, NS does not). The
section measures Muon/AdamW whole-step time at several tokens per rank (micro-batch sizes of the
same ``GPTModel``), divides each by its ideal, and plots both curves to
``bench_out/ideal_ratio.png`` (matplotlib, when it is installed; the JSON says when it is not).

NS FLOPs come from the run (``ShardedMuon``'s step statistics, max over ranks); forward+backward
FLOPs are counted from the model's shapes (:func:`forward_backward_flops`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from benchmarks.launcher import run_ranks
from benchmarks.models import GPTSize
from benchmarks.section import RunContext, Section
from benchmarks.training_step import muon_vs_adamw_step

__all__ = [
    "SECTION",
    "forward_backward_flops",
    "ideal_ratio",
    "ideal_ratio_section",
    "plot_ideal_ratio",
]


def forward_backward_flops(size: GPTSize) -> int:
    """Matmul FLOPs of one rank's forward and backward pass of ``GPTModel`` (local layer spec).

    Per token: 2 FLOPs per weight of each linear layer (QKV ``3h^2``, projection ``h^2``, MLP
    ``2 h ffn``, output layer ``V h``) and the attention products (``QK^T`` and ``AV``: ``2 s h``
    multiply-adds each; the local spec computes the full ``s x s`` scores, the causal mask is
    applied after). Backward costs twice the forward. Elementwise work (norms, softmax, GELU) is
    left out: the count is low by that much, so the ideal is slightly high (a slightly looser
    target).
    """
    h, s = size.hidden, size.seq_length
    weights = size.num_layers * (4 * h * h + 2 * h * size.ffn_hidden) + size.vocab_size * h
    attention = size.num_layers * 2 * s * h
    forward_per_token = 2 * (weights + attention)
    return 3 * forward_per_token * size.tokens_per_rank()


def ideal_ratio(ns_flops_max: float, size: GPTSize) -> float:
    """1 + NS FLOPs on the busiest rank / that rank's forward+backward FLOPs."""
    return 1.0 + ns_flops_max / forward_backward_flops(size)


def ideal_ratio_section(
    size: GPTSize, micro_batches: tuple[int, ...], dp: int, device: str, warmup: int, repeats: int
) -> dict:
    """Muon/AdamW whole-step time at each micro-batch size (DP ``dp``), over its ideal ratio.

    Every point is one launch of ``dp`` ranks running :func:`muon_vs_adamw_step` (the two kinds
    alternate step by step; slowest rank's median).
    """
    rows = []
    for micro_batch in micro_batches:
        point = dataclasses.replace(size, micro_batch=micro_batch)
        results = run_ranks(muon_vs_adamw_step, dp, device, point, warmup, repeats)
        muon_s = max(r["muon"]["step_s"] for r in results)
        adamw_s = max(r["adamw"]["step_s"] for r in results)
        ns_flops = max(r["muon_ns_flops"] for r in results)
        measured = muon_s / adamw_s
        ideal = ideal_ratio(ns_flops, point)
        rows.append(
            {
                "tokens_per_rank": point.tokens_per_rank(),
                "muon_step_s": muon_s,
                "adamw_step_s": adamw_s,
                "muon_over_adamw_step": measured,
                "ns_flops_max": ns_flops,
                "forward_backward_flops": forward_backward_flops(point),
                "ideal_ratio": ideal,
                "measured_over_ideal": measured / ideal,
            }
        )
    return {
        "model": dataclasses.asdict(size),
        "dp": dp,
        "rows": rows,
        "largest_tokens_measured_over_ideal": rows[-1]["measured_over_ideal"],
    }


def plot_ideal_ratio(section: dict, out_dir: Path) -> str:
    """Write ``out_dir/ideal_ratio.png`` (measured and ideal ratio vs tokens per rank).

    Returns the path written, or a sentence saying why no plot was written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not plotted: matplotlib is not installed (pip install matplotlib)"
    tokens = [row["tokens_per_rank"] for row in section["rows"]]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(tokens, [r["muon_over_adamw_step"] for r in section["rows"]], "o-", label="measured")
    axes.plot(tokens, [r["ideal_ratio"] for r in section["rows"]], "s--", label="ideal")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("tokens per rank per step")
    axes.set_ylabel("Muon / AdamW whole-step time")
    axes.set_title(f"GPTModel, Megatron-FSDP DP={section['dp']}")
    axes.legend()
    path = out_dir / "ideal_ratio.png"
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return str(path)


def counted_forward_backward_flops(rank: int, world_size: int, device: str, size: GPTSize) -> int:
    """Rank function: matmul FLOPs of one forward+backward of the benchmark's ``GPTModel``, as
    ``torch.utils.flop_counter.FlopCounterMode`` counts them (checks ``forward_backward_flops``).
    """
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.training_step import Trainer

    trainer = Trainer(size, world_size, device, "adamw")
    with FlopCounterMode(display=False) as counter:
        trainer.forward_backward()
    return int(counter.get_total_flops())


def _run(context: RunContext, results: dict) -> dict:
    config = context.config
    section = ideal_ratio_section(
        config.gpt,
        config.ideal_ratio_micro_batches,
        config.train_dp,
        context.device,
        config.warmup,
        config.repeats,
    )
    section["plot"] = plot_ideal_ratio(section, context.out_dir)
    return section


# No lines of its own: docs/benchmarks.md ("Whole step over its ideal ratio") tabulates
# results.json and shows the plot.
SECTION = Section(
    key="ideal_ratio",
    run=_run,
    figures=("ideal_ratio.rows", "ideal_ratio.largest_tokens_measured_over_ideal"),
    peers=True,
)

"""Overlap of the owner exchange with Newton-Schulz: ``overlap_buckets`` on vs off.

``MuonFsdpConfig(overlap_buckets=True)`` sends bucket k+1's rows to their owners while bucket k runs
NS (``megatron_muon.engine.owner_pipeline``), holding two buckets' full matrices instead of one.
This
section steps both pipelines on the same Megatron-FSDP row shards of the dense model, in turn, at
each DP size of the run, with the run's bucket size, and reports median step time, transient
memory (peak live tensor bytes above the step's start) and the full matrices held at once. The
default of ``overlap_buckets`` is chosen from these figures (docs/benchmarks.md, "Overlap").
"""

from __future__ import annotations

from benchmarks.launcher import run_ranks
from benchmarks.models import TransformerShapes
from benchmarks.optimizer_step import MUON_KWARGS, owner_step_figures, sharded_params
from benchmarks.section import RunContext, Section

__all__ = ["SECTION", "overlap_pair", "overlap_section"]

PIPELINES = {"sequential": False, "overlapped": True}


def overlap_pair(
    rank: int,
    world_size: int,
    device: str,
    shapes: TransformerShapes,
    bucket_size_bytes: int,
    warmup: int,
    repeats: int,
) -> dict:
    """One rank's owner-mode ``ShardedMuon`` with and without ``overlap_buckets``, same shards.

    Returns:
        ``{"sequential" | "overlapped": {"seconds", "transient_bytes", "held_bytes"}}``.
    """
    from megatron_muon import ShardedMuon

    params = sharded_params(shapes, world_size, device)
    optimizers = {
        name: ShardedMuon.from_keywords(
            params,
            mode="owner",
            bucket_size_bytes=bucket_size_bytes,
            overlap_buckets=overlap,
            **MUON_KWARGS,
        )
        for name, overlap in PIPELINES.items()
    }
    return owner_step_figures(optimizers, device, warmup, repeats)


def overlap_section(
    shapes: TransformerShapes,
    device: str,
    dp_sizes: list[int],
    bucket_size_bytes: int,
    warmup: int,
    repeats: int,
) -> dict:
    """Both pipelines at each DP size >= 2 (slowest rank's time, largest memory over ranks)."""
    from megatron_muon.engine.config import MuonFsdpConfig

    by_dp = {}
    for dp in [dp for dp in dp_sizes if dp >= 2]:
        per_rank = run_ranks(overlap_pair, dp, device, shapes, bucket_size_bytes, warmup, repeats)
        entry = {
            name: {
                field: max(r[name][field] for r in per_rank)
                for field in ("seconds", "transient_bytes", "held_bytes")
            }
            for name in PIPELINES
        }
        entry["overlapped_over_sequential_s"] = (
            entry["overlapped"]["seconds"] / entry["sequential"]["seconds"]
        )
        entry["overlapped_over_sequential_transient"] = entry["overlapped"][
            "transient_bytes"
        ] / max(1, entry["sequential"]["transient_bytes"])
        by_dp[str(dp)] = entry
    return {
        "model": shapes.describe(),
        "bucket_size_bytes": bucket_size_bytes,
        "default_overlap_buckets": MuonFsdpConfig().overlap_buckets,
        "by_dp": by_dp,
    }


def _run(context: RunContext, results: dict) -> dict:
    config = context.config
    return overlap_section(
        config.dense,
        context.device,
        context.dp_sizes,
        config.overlap_bucket_size_bytes,
        config.warmup,
        config.repeats,
    )


# No lines of its own: docs/benchmarks.md ("Overlap of the exchange with NS") tabulates
# results.json.
SECTION = Section(
    key="overlap",
    run=_run,
    figures=(
        "overlap.by_dp.*.overlapped_over_sequential_s",
        "overlap.by_dp.*.overlapped_over_sequential_transient",
    ),
    peers=True,
)

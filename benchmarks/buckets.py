"""The exchange bucket size: owner step time and transient memory for each ``bucket_size_bytes``.

``ShardedMuon`` exchanges its matrices bucket by bucket, one bucket's full matrices held at a time
(``bucket_size_bytes``); smaller buckets hold less but exchange more often. This section steps one
optimizer per bucket size on the same Megatron-FSDP row shards of the dense model at DP=2, in turn,
and reports each one's median step time against one bucket (``None``), its transient memory (peak
live tensor bytes above the step's start) and the full matrices it held at once. The smallest
transient memory within 5% of one bucket's time is what the default was chosen by.
"""

from __future__ import annotations

from benchmarks.launcher import run_ranks
from benchmarks.models import TransformerShapes
from benchmarks.optimizer_step import MUON_KWARGS, owner_step_figures, sharded_params
from benchmarks.section import RunContext, Section

__all__ = ["SECTION", "bucket_section", "bucket_sweep", "format_buckets"]

SLOWDOWN_BOUND = 1.05


def bucket_sweep(
    rank: int,
    world_size: int,
    device: str,
    shapes: TransformerShapes,
    bucket_sizes: list[int | None],
    warmup: int,
    repeats: int,
) -> dict:
    """One rank's owner-mode ``ShardedMuon`` with each bucket size on the same row shards.

    Returns:
        ``{str(bucket size): {"seconds", "transient_bytes", "held_bytes"}}`` (``"None"``: one
        bucket): median step seconds (optimizers stepped in turn), one step's transient memory,
        the fp32 bytes of full matrices held at once.
    """
    from megatron_muon import ShardedMuon

    params = sharded_params(shapes, world_size, device)
    optimizers = {
        str(size): ShardedMuon.from_keywords(
            params, mode="owner", bucket_size_bytes=size, **MUON_KWARGS
        )
        for size in bucket_sizes
    }
    return owner_step_figures(optimizers, device, warmup, repeats)


def bucket_section(
    shapes: TransformerShapes,
    device: str,
    bucket_sizes: tuple[int | None, ...],
    warmup: int,
    repeats: int,
) -> dict:
    """Each bucket size's figures at DP=2 (slowest rank's time, largest memory over ranks)."""
    from megatron_muon.engine.config import DEFAULT_BUCKET_SIZE_BYTES

    per_rank = run_ranks(bucket_sweep, 2, device, shapes, list(bucket_sizes), warmup, repeats)
    whole = max(r["None"]["seconds"] for r in per_rank)
    by_bucket = {}
    for name in per_rank[0]:
        seconds = max(r[name]["seconds"] for r in per_rank)
        by_bucket[name] = {
            "seconds": seconds,
            "over_one_bucket": seconds / whole,
            "transient_bytes": max(r[name]["transient_bytes"] for r in per_rank),
            "held_bytes": max(r[name]["held_bytes"] for r in per_rank),
        }
    within = [name for name, e in by_bucket.items() if e["over_one_bucket"] <= SLOWDOWN_BOUND]
    return {
        "dp": 2,
        "model": shapes.describe(),
        "default_bucket_size_bytes": DEFAULT_BUCKET_SIZE_BYTES,
        "by_bucket": by_bucket,
        "least_memory_within_5_percent": min(
            within, key=lambda name: by_bucket[name]["transient_bytes"]
        ),
    }


def _label(name: str) -> str:
    return "one bucket" if name == "None" else f"{int(name) / 2**20:g} MiB"


def format_buckets(section: dict) -> list[str]:
    """The sweep as Markdown lines."""
    lines = [
        f"**Exchange bucket size** (owner step, DP={section['dp']}, {section['model']}; stepped "
        "in turn; the default is "
        f"{_label(str(section['default_bucket_size_bytes']))})",
        "",
        "| bucket_size_bytes | step s | time / one bucket | transient memory | full matrices "
        "held | transient / held |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, e in section["by_bucket"].items():
        lines.append(
            f"| {_label(name)} | {e['seconds']:.3f} | {e['over_one_bucket']:.3f} | "
            f"{e['transient_bytes'] / 2**20:.1f} MiB | {e['held_bytes'] / 2**20:.1f} MiB | "
            f"{e['transient_bytes'] / max(1, e['held_bytes']):.2f} |"
        )
    best = _label(section["least_memory_within_5_percent"])
    lines += ["", f"Least transient memory within 5% of one bucket's time in this run: {best}."]
    return lines


def _run(context: RunContext, results: dict) -> dict:
    config = context.config
    return bucket_section(
        config.dense, context.device, config.bucket_sizes, config.warmup, config.repeats
    )


def _lines(results: dict) -> list[str]:
    return [*format_buckets(results["buckets"]), ""]


SECTION = Section(
    key="buckets",
    run=_run,
    figures=("buckets.by_bucket", "buckets.least_memory_within_5_percent"),
    report=_lines,
    markdown=_lines,
)

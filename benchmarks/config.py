"""Sizes and repeat counts of a benchmark run: the full run (``make bench``) and ``--quick``."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.models import GPTSize, TransformerShapes

__all__ = ["FULL", "QUICK", "BenchConfig"]


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Sizes and repeat counts of one benchmark run."""

    dense: TransformerShapes
    moe: TransformerShapes
    dp_sizes: tuple[int, ...]
    gpt: GPTSize
    train_dp: int
    scaling: tuple[TransformerShapes, ...]
    scaling_dp: int
    warmup: int
    repeats: int
    # Timed steps of each side in the peers section: the step-to-step spread of a shared 2-core
    # CPU (~0.3 s of a ~3 s step) is wider than the margins that section compares.
    peer_repeats: int
    matmul_size: int
    bucket_size_bytes: int
    bucket_sizes: tuple[int | None, ...]
    ns_methods_argv: tuple[str, ...]
    # Micro-batch sizes of the ideal-ratio sweep (benchmarks.ideal_ratio), at gpt's seq_length.
    ideal_ratio_micro_batches: tuple[int, ...]
    # Bucket size of the overlap section (benchmarks.overlap): several buckets of the dense model.
    overlap_bucket_size_bytes: int


FULL = BenchConfig(
    dense=TransformerShapes(num_layers=8, hidden=512, ffn_hidden=2048),
    # Fine-grained experts: 8 x 256 = the dense MLP's width (per layer, the same expert weights as
    # the dense MLP); 4 layers keep the run within its time.
    moe=TransformerShapes(num_layers=4, hidden=512, ffn_hidden=256, num_experts=8),
    dp_sizes=(1, 2, 4),
    gpt=GPTSize(
        num_layers=8,
        hidden=512,
        ffn_hidden=2048,
        num_heads=8,
        vocab_size=8192,
        seq_length=256,
        micro_batch=2,
    ),
    train_dp=2,
    scaling=tuple(TransformerShapes(1, h, 4 * h) for h in (256, 512, 1024)),
    scaling_dp=2,
    warmup=1,
    repeats=3,
    peer_repeats=7,
    matmul_size=2048,
    bucket_size_bytes=4 * 2**20,
    bucket_sizes=(None, 32 * 2**20, 16 * 2**20, 8 * 2**20, 4 * 2**20),
    ns_methods_argv=(),
    # 512, 2048 and 4096 tokens per rank (8192 would add ~3 min on 2 CPU cores).
    ideal_ratio_micro_batches=(2, 8, 16),
    overlap_bucket_size_bytes=16 * 2**20,  # ShardedMuon's default: 6 buckets of the dense model
)

QUICK = BenchConfig(
    dense=TransformerShapes(num_layers=2, hidden=64, ffn_hidden=256),
    moe=TransformerShapes(num_layers=2, hidden=64, ffn_hidden=32, num_experts=8),
    dp_sizes=(1, 2, 4),
    gpt=GPTSize(
        num_layers=2,
        hidden=64,
        ffn_hidden=256,
        num_heads=4,
        vocab_size=512,
        seq_length=32,
        micro_batch=2,
    ),
    train_dp=2,
    scaling=tuple(TransformerShapes(1, h, 4 * h) for h in (32, 64, 128)),
    scaling_dp=2,
    warmup=1,
    repeats=2,
    peer_repeats=2,
    matmul_size=256,
    bucket_size_bytes=16 * 2**10,
    bucket_sizes=(None, 64 * 2**10, 16 * 2**10),
    ns_methods_argv=("--k", "64", "--ratios", "1", "4", "--experts", "2", "--repeats", "2"),
    ideal_ratio_micro_batches=(1, 2, 4),
    overlap_bucket_size_bytes=16 * 2**10,
)

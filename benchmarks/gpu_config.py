"""Sizes of the GPU run (``benchmarks.gpu_run``): ``GPU`` for an 80 GB card, ``QUICK_CPU`` for its
code path on CPU ranks (``tests/test_gpu_benchmarks.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.models import GPTSize, TransformerShapes

__all__ = ["GPU", "QUICK_CPU", "SECTION_NAMES", "GpuBenchConfig"]

# The sections of the GPU run (``benchmarks.gpu_run.run``), in order; ``python -m benchmarks
# --device cuda --section NAME`` runs some of them.
SECTION_NAMES = ("matmul", "newton_schulz", "stock", "gram", "symmetric", "training", "syrk")


@dataclass(frozen=True, slots=True)
class GpuBenchConfig:
    """Sizes of the GPU run."""

    matmul_size: int
    ns_shapes: tuple[tuple[int, int], ...]
    stock: TransformerShapes
    gram_k: int
    gram_ratios: tuple[int, ...]
    gpt: GPTSize
    warmup: int
    repeats: int


GPU = GpuBenchConfig(
    matmul_size=8192,
    # Hidden 4096 and 8192: attention (h, h), MLP (4h, h) and Llama-style (3.5h, h) weights.
    ns_shapes=((4096, 4096), (16384, 4096), (8192, 8192), (28672, 8192)),
    stock=TransformerShapes(num_layers=4, hidden=4096, ffn_hidden=16384),
    gram_k=4096,
    gram_ratios=(1, 4, 8),
    # 1.07B params (Llama-3.2-1B's widths, 16 heads, untied-free: output shares the embedding).
    gpt=GPTSize(
        num_layers=16,
        hidden=2048,
        ffn_hidden=8192,
        num_heads=16,
        vocab_size=131072,
        seq_length=4096,
        micro_batch=1,
    ),
    warmup=3,
    repeats=10,
)

QUICK_CPU = GpuBenchConfig(
    matmul_size=128,
    ns_shapes=((64, 64), (256, 64)),
    stock=TransformerShapes(num_layers=1, hidden=64, ffn_hidden=256),
    gram_k=32,
    gram_ratios=(1, 4),
    gpt=GPTSize(
        num_layers=2,
        hidden=64,
        ffn_hidden=256,
        num_heads=4,
        vocab_size=512,
        seq_length=32,
        micro_batch=2,
    ),
    warmup=1,
    repeats=2,
)

"""This CPU's fp32 and bf16 matmul rates, and whether bf16 is too slow for Muon's default precision.

Megatron's default ``--muon-fp32-matmul-prec medium`` runs Newton-Schulz's matmuls in bf16. On a
CPU with bf16 instructions (AVX512-BF16, AMX) that is about as fast as fp32; on one without them
(AVX2 machines such as AMD Zen 3) bf16 matmuls are emulated: measured at 1 GFLOP/s against 84 in
fp32 on a Zen 3 core, 0.3 against 23 with an Intel Xeon's kernels limited to AVX2. Then NS, and
with it the whole optimizer step, is tens of times slower than with
``FP32_NS_FLAGS`` (NS in fp32), which is also exact. The pretrain entry point
and the demo say so once at start (``slow_bf16_message``); the default stays Megatron's, so that
the numerics of a run never depend on the machine without the user choosing it. ``make bench``
picks its NS precision from the same rates.
"""

from __future__ import annotations

import time

import torch

__all__ = [
    "BF16_SLOW_FACTOR",
    "FP32_NS_FLAGS",
    "measure_matmul_rates",
    "bf16_is_slow",
    "slow_bf16_message",
]

# bf16 counts as slow when it is more than this many times slower than fp32.
BF16_SLOW_FACTOR = 4.0
# The flags that run NS in fp32. Megatron-LM's --muon-fp32-matmul-prec accepts low, medium and high
# (not torch's "highest"); under "high" emerging-optimizers' newton_schulz keeps fp32 (it casts to
# bf16 under "medium" only), and a CPU without bf16 instructions has no reduced-precision fp32
# GEMM either: measured bitwise equal to "highest" on a 2-core AMD EPYC.
FP32_NS_FLAGS = ("--muon-fp32-matmul-prec", "high")


def measure_matmul_rates(size: int = 256, repeats: int = 3) -> dict[str, float]:
    """FLOP/s of a ``size``^3 matmul in fp32 and in bf16 on the CPU, one thread, the median of
    ``repeats`` products after one untimed (at 256, a few milliseconds; a second on emulated bf16).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    rates = {}
    try:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a = torch.randn(size, size, generator=generator).to(dtype)
            b = torch.randn(size, size, generator=generator).to(dtype)
            a @ b
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                seconds.append(time.perf_counter() - start)
            rates[name] = 2 * size**3 / sorted(seconds)[len(seconds) // 2]
    finally:
        torch.set_num_threads(threads)
    return rates


def bf16_is_slow(rates: dict[str, float]) -> bool:
    """Whether bf16 matmuls run more than ``BF16_SLOW_FACTOR`` times slower than fp32."""
    return rates["bf16"] * BF16_SLOW_FACTOR < rates["fp32"]


def slow_bf16_message(rates: dict[str, float]) -> str:
    """The one-line notice for a CPU whose bf16 matmuls are slow (``bf16_is_slow``)."""
    return (
        f"bf16 matmuls run at {rates['bf16'] / 1e9:.1f} GFLOP/s on this CPU against "
        f"{rates['fp32'] / 1e9:.1f} in fp32 (no bf16 instructions): Muon's Newton-Schulz under "
        "--muon-fp32-matmul-prec medium (Megatron's default, bf16 matmuls) will be "
        f"~{rates['fp32'] / rates['bf16']:.0f}x slower than with {' '.join(FP32_NS_FLAGS)} "
        "(fp32 matmuls, exact); pass that flag to train faster here."
    )

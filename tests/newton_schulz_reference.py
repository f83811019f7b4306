"""References of the Newton-Schulz accuracy tests: the NS polynomial evaluated in float64 straight
from its definition (``float64_polynomial``), the coefficient schedules tested (``SCHEDULES``,
``schedule_of``), inputs with a spread spectrum (``spread_matrix``) and the deviation measured
(``sv_deviation``: max over singular values, the quantity Muon's update depends on).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_muon.newton_schulz.methods import coefficient_schedule

# (coefficient_type, steps): every emerging-optimizers set at its natural length, plus schedules
# longer than their list (repeat_last for polar_express, cycle for quintic).
SCHEDULES = [
    ("simple", 5),
    ("quintic", 5),
    ("quintic", 7),
    ("polar_express", 5),
    ("polar_express", 8),
    ("cans", 5),
    ("aol", 4),
    ("deepseekv4", 10),
]
CUSTOM = ((3.0, -3.2, 1.2), (2.0, -1.5, 0.5))


def spread_matrix(shape: Sequence[int], low_exponent: float, seed: int) -> torch.Tensor:
    """fp32 matrices with singular values log-spaced over [10^low_exponent, 1], random vectors.

    Momentum matrices are far from Gaussian: a few large directions and a long tail of tiny ones;
    the tail is where Gram NS is weakest (R = X X^T squares it below rounding).
    """
    generator = torch.Generator().manual_seed(seed)
    *batch, rows, cols = shape
    k = min(rows, cols)
    out = []
    for _ in range(batch[0] if batch else 1):
        u, _ = torch.linalg.qr(torch.randn(rows, k, generator=generator, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(cols, k, generator=generator, dtype=torch.float64))
        s = torch.logspace(0, low_exponent, k, dtype=torch.float64)
        out.append((u * s[torch.randperm(k, generator=generator)]) @ v.T)
    stacked = torch.stack(out).float()
    return stacked if batch else stacked[0]


def float64_polynomial(
    x: torch.Tensor, schedule: Sequence[tuple[float, float, float]]
) -> torch.Tensor:
    """The NS polynomial in float64, straight from its definition (no Gram rewriting)."""
    y = x.double()
    transpose = y.size(-2) > y.size(-1)
    if transpose:
        y = y.mT
    y = y / y.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-7)
    for a, b, c in schedule:
        gram = y @ y.mT
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.mT if transpose else y


def sv_deviation(result: torch.Tensor, reference: torch.Tensor) -> float:
    """max |sv(result) - sv(reference)| over all singular values (and batch entries)."""
    if not torch.isfinite(result).all():
        return float("inf")
    sv = torch.linalg.svdvals(result.double())
    return (sv - torch.linalg.svdvals(reference.double())).abs().max().item()


def schedule_of(coefficient_type: str, steps: int) -> list[tuple[float, float, float]]:
    custom = CUSTOM if coefficient_type == "custom" else None
    return coefficient_schedule(steps, coefficient_type, custom)

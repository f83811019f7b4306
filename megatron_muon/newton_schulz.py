"""Newton-Schulz orthogonalization as pure functions on plain local tensors.

The iteration itself is emerging-optimizers' ``newton_schulz`` (the same code megatron-core's
``TensorParallelMuon`` runs); this module adds what a sharded optimizer needs around it:

- ``orthogonalize_batch``: same-shape matrices orthogonalized in one batched NS call;
- ``scaled_orthogonalize``: NS followed by Muon's scale factor, exactly as ``TensorParallelMuon``'s
  ``scaled_orthogonalize_fn`` computes it for an untensor-parallel matrix;
- ``ns_flops``: the FLOPs NS performs on a matrix, the cost model of the owner planner.

Inputs are plain ``torch.Tensor`` (never DTensor), fp32, 2-D ``(M, N)`` or 3-D ``(B, M, N)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from emerging_optimizers.orthogonalized_optimizers.muon import get_muon_scale_factor
from emerging_optimizers.orthogonalized_optimizers.muon_utils import NSCoeffT, newton_schulz

__all__ = [
    "NSConfig",
    "MuonScaleT",
    "ns_flops",
    "orthogonalize_batch",
    "scaled_orthogonalize",
]

MuonScaleT = Literal["spectral", "unit_rms_norm", "shape_scaling"]


@dataclass(frozen=True, slots=True)
class NSConfig:
    """How a matrix is orthogonalized: NS iteration plus Muon's update scale.

    Mirrors ``TensorParallelMuon``'s constructor arguments of the same names.
    """

    num_ns_steps: int = 5
    coefficient_type: NSCoeffT = "quintic"
    scale_mode: MuonScaleT = "spectral"
    extra_scale_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.num_ns_steps < 1:
            raise ValueError(f"num_ns_steps must be at least 1, got {self.num_ns_steps}")

    def shape_scale(self, rows: int, cols: int) -> float:
        """Muon's shape-dependent update scale for a ``(rows, cols)`` matrix (without the extra)."""
        return get_muon_scale_factor(rows, cols, mode=self.scale_mode)


def ns_flops(rows: int, cols: int, num_ns_steps: int) -> int:
    """FLOPs of ``num_ns_steps`` NS iterations on a ``(rows, cols)`` matrix.

    NS works on the smaller side ``k = min(rows, cols)``, ``l = max(rows, cols)``. Each step computes
    ``A = X X^T`` (2 k^2 l), ``B = bA + cA A`` (2 k^3) and ``X = aX + B X`` (2 k^2 l).
    """
    k, long = min(rows, cols), max(rows, cols)
    return num_ns_steps * (4 * k * k * long + 2 * k * k * k)


def orthogonalize_batch(matrices: Sequence[torch.Tensor], config: NSConfig) -> list[torch.Tensor]:
    """Orthogonalizes same-shape fp32 matrices in one batched NS call, then scales each.

    Args:
        matrices: ``B`` tensors of one shape ``(M, N)``, fp32, plain (not DTensor).
        config: NS steps, coefficients and scale.

    Returns:
        ``B`` tensors ``(M, N)``: ``NS(m) * scale(M, N)``. A single matrix takes the 2-D path so
        its result is bitwise the one ``TensorParallelMuon`` computes.
    """
    if not matrices:
        return []
    rows, cols = matrices[0].shape
    if len(matrices) == 1:
        return [scaled_orthogonalize(matrices[0], config)]
    stacked = torch.stack(list(matrices))
    orthogonal = newton_schulz(stacked, config.num_ns_steps, config.coefficient_type)
    # Two multiplications, in TensorParallelMuon's order, so results match it bitwise.
    orthogonal = orthogonal * config.shape_scale(rows, cols) * config.extra_scale_factor
    return list(orthogonal.unbind(0))


def scaled_orthogonalize(matrix: torch.Tensor, config: NSConfig) -> torch.Tensor:
    """``NS(matrix) * scale`` for a 2-D ``(M, N)`` or 3-D ``(B, M, N)`` fp32 tensor."""
    rows, cols = matrix.shape[-2], matrix.shape[-1]
    orthogonal = newton_schulz(matrix, config.num_ns_steps, config.coefficient_type)
    return orthogonal * config.shape_scale(rows, cols) * config.extra_scale_factor

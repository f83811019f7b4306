"""Symmetric Newton-Schulz: the standard iteration, its two symmetric products computed by halves.

Step ``t`` of the standard iteration on ``X`` (``(k, l)`` after transposing so that ``k <= l``) is
``A = X X^T``, ``B = b_t A + c_t A A``, ``X <- a_t X + B X``. ``A`` and ``B`` are symmetric, so
only the blocks on and below the diagonal of a 2 x 2 split are computed (``h = ceil(k / 2)``):

- ``A[:, :h] = X X[:h]^T`` and ``A[h:, h:] = X[h:] X[h:]^T``, then ``A[:h, h:] = A[h:, :h]^T``;
- ``B`` the same way from ``A`` (``A A[:, :h]`` and ``A[h:] A[:, h:]``).

Three of the four blocks of each product: per step ``1.5 k^2 l + 1.5 k^3 + 2 k^2 l`` matmul FLOPs
against the standard ``4 k^2 l + 2 k^3`` (``symmetric_ns_flops``), 12 to 17% fewer, as a syrk
kernel does (emerging-optimizers' ``use_syrk``, a Triton kernel for bf16 on GPUs). The polynomial,
coefficients, normalization and precision are ``newton_schulz``'s: results differ from it by fp32
reduction order only (under ``"medium"`` fp32 matmul precision the matmuls run in bf16, as
``newton_schulz`` runs them).

Inputs and outputs are plain fp32 tensors, 2-D ``(M, N)`` or batched 3-D ``(B, M, N)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["symmetric_newton_schulz", "symmetric_ns_flops"]


def symmetric_ns_flops(rows: int, cols: int, num_ns_steps: int) -> int:
    """Matmul FLOPs of ``symmetric_newton_schulz`` on a ``(rows, cols)`` matrix (module docstring).

    With ``k = min(rows, cols)``, ``l = max(rows, cols)``, ``h = ceil(k / 2)``, per step:
    ``X X[:h]^T`` (2 k h l), ``X[h:] X[h:]^T`` (2 (k - h)^2 l), ``A A[:, :h]`` (2 k^2 h),
    ``A[h:] A[:, h:]`` (2 (k - h)^2 k) and ``B X`` (2 k^2 l).
    """
    k, long = min(rows, cols), max(rows, cols)
    h = (k + 1) // 2
    rest = k - h
    per_step = 2 * k * h * long + 2 * rest * rest * long + 2 * k * k * h + 2 * rest * rest * k
    return num_ns_steps * (per_step + 2 * k * k * long)


def symmetric_newton_schulz(
    x: torch.Tensor, schedule: Sequence[tuple[float, float, float]], eps: float = 1e-7
) -> torch.Tensor:
    """NS of ``x`` with one ``(a, b, c)`` per step of ``schedule`` (module docstring).

    Args:
        x: fp32, ``(M, N)`` or ``(B, M, N)``.
        schedule: the coefficients of each step (``coefficient_schedule``).
        eps: as ``newton_schulz``'s, in the Frobenius normalization.

    Returns:
        fp32, the shape of ``x``.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"symmetric_newton_schulz needs float32 input, got {x.dtype}")
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    X = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=eps)  # type: ignore[arg-type]  # torch takes a dim tuple
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.bfloat16)  # newton_schulz's bf16 matmuls under "medium"
    for a, b, c in schedule:
        A = _outer(X)
        B = _polynomial(A, b, c)
        X = _addmm(X, B, X, a, 1.0)
    X = X.to(torch.float32)
    return X.mT if transpose else X


def _outer(X: torch.Tensor) -> torch.Tensor:
    """``X X^T``, ``(..., k, k)``, from its blocks ``[:, :h]`` and ``[h:, h:]``."""
    k = X.size(-2)
    h = (k + 1) // 2
    out = X.new_empty((*X.shape[:-2], k, k))
    torch.matmul(X, X[..., :h, :].mT, out=out[..., :, :h])
    if h < k:
        torch.matmul(X[..., h:, :], X[..., h:, :].mT, out=out[..., h:, h:])
    return _mirror(out, h)


def _polynomial(A: torch.Tensor, b: float, c: float) -> torch.Tensor:
    """``b A + c A A`` of a symmetric ``A``, ``(..., k, k)``, from its blocks ``[:, :h]`` and
    ``[h:, h:]``."""
    k = A.size(-1)
    h = (k + 1) // 2
    out = torch.empty_like(A)
    out[..., :, :h] = _addmm(A[..., :, :h], A, A[..., :, :h], b, c)
    if h < k:
        out[..., h:, h:] = _addmm(A[..., h:, h:], A[..., h:, :], A[..., :, h:], b, c)
    return _mirror(out, h)


def _mirror(out: torch.Tensor, h: int) -> torch.Tensor:
    """Fills the block ``[:h, h:]`` of a symmetric matrix from its block ``[h:, :h]``."""
    out[..., :h, h:] = out[..., h:, :h].mT
    return out


def _addmm(
    bias: torch.Tensor, left: torch.Tensor, right: torch.Tensor, beta: float, alpha: float
) -> torch.Tensor:
    """``beta * bias + alpha * left @ right``, 2-D or batched 3-D."""
    if left.ndim == 2:
        return torch.addmm(bias, left, right, beta=beta, alpha=alpha)
    return torch.baddbmm(bias, left, right, beta=beta, alpha=alpha)

"""Gram Newton-Schulz: the standard NS polynomial of a matrix, iterated on its small Gram matrix.

Gram Newton-Schulz (Zhang, Amsel, Chen, Dao, 2026,
https://dao-ailab.github.io/blog/2026/gram-newton-schulz/) computes the same polynomial of ``X``
as the standard iteration (``(k, l)`` after transposing so that ``k <= l``; step ``t`` is
``X <- (a_t I + b_t X X^T + c_t (X X^T)^2) X``), but iterates on the ``(k, k)`` Gram matrix
``R = X X^T`` and applies the accumulated polynomial ``Q`` to ``X`` once at the end: fewer FLOPs
when ``l`` is well above ``k`` (``gram_ns_flops``).

Restarts (``default_gram_restarts``) rebuild ``X`` and ``R`` from ``Q`` every few iterations,
because ``R`` accumulates rounding that the ``a^2`` growth per step amplifies. Precision: the
matmuls run in ``compute_dtype``, under "medium" fp32 matmul precision a half dtype, fp16 by
default as Gram NS's authors do: ``R`` squares the singular values, so it needs mantissa more than
range (``X`` is normalized, ``|R_ij| <= 1``), and fp16 has 3 more mantissa bits than bf16; bf16
needs a restart every 2 iterations instead of 3. Measured accuracy and speed of both dtypes:
docs/newton_schulz.md.

Inputs and outputs are plain fp32 tensors, 2-D ``(M, N)`` or batched 3-D ``(B, M, N)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_muon.common.options import GramHalfDtypeT

__all__ = ["check_restarts", "default_gram_restarts", "gram_newton_schulz", "gram_ns_flops"]


def default_gram_restarts(
    num_steps: int, half_dtype: GramHalfDtypeT = "float16"
) -> tuple[int, ...]:
    """Default Gram restart positions: after iteration 2, then every 3 (fp16) or 2 (bf16) more.

    Five steps with fp16 restart once, after the second, as Gram NS's authors do: the first
    iterations have the largest ``a`` and amplify rounding in ``R`` by ``a^2`` per step, so ``R`` is
    rebuilt from ``X`` before its error outgrows fp16. Longer schedules restart every 3 further
    iterations: without them, 10-step DeepSeek-V4 coefficients diverge even in fp32 on
    ill-conditioned matrices. bf16's 8-bit mantissa needs a restart every 2 iterations. The
    schedule does not depend on the run's matmul precision, so the FLOP count (the planner's cost
    model) knows it from the config alone.
    """
    return tuple(range(2, num_steps, 3 if half_dtype == "float16" else 2))


def gram_ns_flops(rows: int, cols: int, num_ns_steps: int, restarts: Sequence[int]) -> int:
    """Matmul FLOPs of ``gram_newton_schulz`` with ``restarts`` on a ``(rows, cols)`` matrix.

    With ``k = min(rows, cols)``, ``l = max(rows, cols)`` and ``S - 1`` restarts (``S`` segments),
    it computes, per segment, ``R = X X^T`` at its start and ``X = Q X`` at its end (2 k^2 l each);
    per step ``Z = bR + cR R`` (2 k^3), except at a segment's first step ``Q = aQ + Q Z`` (2 k^3),
    and except at its last step ``R = (aI + Z) R (aI + Z)`` (two products, 4 k^3):
    ``4 S k^2 l + 2 k^3 (4 T - 3 S)`` for ``T`` steps. That is below the standard iteration's
    ``T (4 k^2 l + 2 k^3)`` iff ``T > S`` and ``l > 1.5 k``.
    """
    k, long = min(rows, cols), max(rows, cols)
    segments = len(restarts) + 1
    return 4 * segments * k * k * long + 2 * k * k * k * (4 * num_ns_steps - 3 * segments)


def gram_newton_schulz(
    x: torch.Tensor,
    coefficients: Sequence[tuple[float, float, float]],
    restarts: Sequence[int] = (),
    eps: float = 1e-7,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Gram Newton-Schulz: the standard NS polynomial of ``x``, iterated on ``R = X X^T``.

    With ``X`` transposed to ``(k, l)``, ``k <= l``, and normalized by its Frobenius norm, standard
    NS step ``t`` is ``X_t = P_t X_{t-1}`` with ``P_t = a I + b R_{t-1} + c R_{t-1}^2`` and
    ``R_t = X_t X_t^T = P_t R_{t-1} P_t`` (``P_t`` is a polynomial in ``R_{t-1}``, so all commute).
    Gram NS keeps ``Q_t = P_t ... P_1`` and ``R_t`` (both ``(k, k)``) and forms ``X_T = Q_T X_0``
    once. ``R_t`` accumulates rounding that the ``a^2`` growth per step amplifies, and eigenvalues
    of ``R`` that rounding pushed below zero diverge under the polynomial; a restart (after the
    iterations in ``restarts``) sets ``X = Q X``, ``R = X X^T``, ``Q = I`` to start from a Gram
    matrix that is positive semi-definite up to one rounding again.

    This function always runs the Gram iteration (no FLOPs fallback; the registry's ``"gram"``
    method in ``newton_schulz`` has it).

    Args:
        x: ``(M, N)`` or batched ``(B, M, N)``, fp32; each matrix is orthogonalized on its own.
        coefficients: the ``(a, b, c)`` triple of each iteration
            (``newton_schulz.coefficient_schedule``).
        restarts: restart after these many iterations, each in ``[1, len(coefficients))``.
        eps: added to the Frobenius norm before dividing, as in ``newton_schulz``.
        compute_dtype: matmul dtype (fp32, fp16, bf16; see the module docstring for restarts
            that keep each accurate). ``None``: fp16 when
            ``torch.get_float32_matmul_precision() == "medium"``, fp32 otherwise.

    Returns:
        fp32 tensor of ``x``'s shape.
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"x must be 2-D (M, N) or 3-D (B, M, N), got shape {tuple(x.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    check_restarts(tuple(restarts), len(coefficients))
    if compute_dtype is None:
        medium = torch.get_float32_matmul_precision() == "medium"
        compute_dtype = torch.float16 if medium else torch.float32

    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    # torch's stub types normalize's dim as int; it takes a tuple of dims (the Frobenius norm here).
    x = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=eps)  # type: ignore[arg-type]  # see above
    x = x.to(compute_dtype)

    restart_set = set(restarts)
    last = len(coefficients) - 1
    gram = x @ x.mT
    q: torch.Tensor | None = None
    for step, (a, b, c) in enumerate(coefficients):
        if step in restart_set:
            assert q is not None  # restarts are >= 1 (check_restarts): step 0 set q
            x = q @ x
            gram = x @ x.mT
            q = None
        z = _addmm(gram, gram, gram, beta=b, alpha=c)  # b R + c R^2
        if q is None:  # first step of a segment: Q = a I + Z
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = _addmm(q, q, z, beta=a, alpha=1.0)  # a Q + Q Z
        if step != last and step + 1 not in restart_set:
            rz = _addmm(gram, gram, z, beta=a, alpha=1.0)  # (a I + Z) R
            gram = _addmm(rz, z, rz, beta=a, alpha=1.0)  # (a I + Z) R (a I + Z)
    assert q is not None  # coefficients is not empty (NSConfig: num_ns_steps >= 1)
    x = (q @ x).to(torch.float32)
    return x.mT if transpose else x


def _addmm(
    input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: float, alpha: float
) -> torch.Tensor:
    """``beta * input + alpha * mat1 @ mat2``, 2-D (``addmm``) or batched 3-D (``baddbmm``)."""
    if mat1.ndim == 2:
        return torch.addmm(input, mat1, mat2, beta=beta, alpha=alpha)
    return torch.baddbmm(input, mat1, mat2, beta=beta, alpha=alpha)


def check_restarts(restarts: tuple[int, ...], num_steps: int) -> None:
    """Raises ValueError unless ``restarts`` is increasing and inside ``[1, num_steps)``."""
    if any(not 1 <= r < num_steps for r in restarts) or list(restarts) != sorted(set(restarts)):
        raise ValueError(
            f"gram restarts must be increasing iteration counts in [1, {num_steps}), got {restarts}"
        )

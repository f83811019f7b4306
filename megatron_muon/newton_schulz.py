"""Newton-Schulz orthogonalization as pure functions on plain local tensors.

Two NS methods compute the same polynomial of a matrix ``X`` (``(k, l)`` after transposing so that
``k <= l``), step ``t`` being ``X <- (a_t I + b_t X X^T + c_t (X X^T)^2) X``:

- ``"standard"``: emerging-optimizers' ``newton_schulz`` (the code megatron-core's
  ``TensorParallelMuon`` runs), iterating on ``X`` itself;
- ``"gram"``: Gram Newton-Schulz (Zhang, Amsel, Chen, Dao, 2026,
  https://dao-ailab.github.io/blog/2026/gram-newton-schulz/), iterating on the small ``(k, k)``
  Gram matrix ``R = X X^T`` and applying the accumulated polynomial ``Q`` to ``X`` once at the end.
  Fewer FLOPs when ``l`` is well above ``k``; where it would not save FLOPs (near-square matrices)
  it runs the standard iteration instead, so ``ns_flops`` is never worse than the standard count.

Around the iteration, this module adds what a sharded optimizer needs:

- ``orthogonalize_batch``: same-shape matrices orthogonalized in one batched NS call;
- ``scaled_orthogonalize``: NS followed by Muon's scale factor, exactly as ``TensorParallelMuon``'s
  ``scaled_orthogonalize_fn`` computes it for an untensor-parallel matrix;
- ``ns_flops``: the matmul FLOPs NS performs on a matrix, the cost model of the owner planner.

Coefficients: every emerging-optimizers ``NSCoeffT`` set (``simple``, ``quintic``,
``polar_express``, ``cans``, ``aol``, ``deepseekv4``, ``custom``) works with both methods and with
the same schedule: ``polar_express``, ``cans`` and ``deepseekv4`` repeat their last triple past the
end of the list, the others (and ``custom``) cycle through it (``coefficient_schedule``).

Precision. Inputs are plain ``torch.Tensor`` (never DTensor), fp32, 2-D ``(M, N)`` or 3-D
``(B, M, N)``; results are fp32. When ``torch.get_float32_matmul_precision() == "medium"``
(Megatron's default ``--muon-fp32-matmul-prec``), the standard method runs its matmuls in bf16 (as
``newton_schulz`` does) and the Gram method in ``NSConfig.gram_half_dtype``, fp16 by default as Gram
NS's authors do: ``R = X X^T`` squares the singular values, so ``R`` needs mantissa more than range
(``X`` is normalized, ``|R_ij| <= 1``), and fp16 has 3 more mantissa bits than bf16. Measured on
spectra spread over 1e-8..1 (tests/test_newton_schulz.py), fp16 Gram NS with one restart per 3
steps deviates from the float64 polynomial 5-10x less than bf16 standard NS does; bf16 Gram NS needs
a restart every 2 steps to match bf16 standard NS (and diverges with fp16's schedule), which costs
FLOPs (1.29x fewer than standard at aspect ratio 4 instead of 1.5x). On CPUs without fp16 GEMMs
(most), fp16 matmuls are emulated and ~100x slower: choose ``gram_half_dtype="bfloat16"`` there.
CANS coefficients are fp32-only in practice: even standard NS in bf16 deviates by 0.2-0.7 in
singular values on Gaussian matrices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, cycle, islice, repeat
from typing import Literal

import torch
from emerging_optimizers.orthogonalized_optimizers.muon import get_muon_scale_factor
from emerging_optimizers.orthogonalized_optimizers.muon_utils import (
    _COEFFICIENT_SETS,
    NSCoeffT,
    newton_schulz,
)

from megatron_muon.options import GramHalfDtypeT, MuonScaleT, check_choice

__all__ = [
    "NSConfig",
    "NSMethodT",
    "coefficient_schedule",
    "default_gram_restarts",
    "gram_newton_schulz",
    "ns_flops",
    "orthogonalize",
    "orthogonalize_batch",
    "scaled_orthogonalize",
    "uses_gram",
]

NSMethodT = Literal["standard", "gram"]
CoefficientT = tuple[float, float, float]

# The sets that newton_schulz extends by repeating their last triple; all others cycle. This mirrors
# a local tuple inside emerging-optimizers' newton_schulz (no public name); the test
# test_schedule_reproduces_emerging_newton_schulz pins the two together bitwise.
_REPEAT_LAST_TYPES: frozenset[str] = frozenset({"polar_express", "cans", "deepseekv4"})


@dataclass(frozen=True, slots=True)
class NSConfig:
    """How a matrix is orthogonalized: NS method and coefficients, plus Muon's update scale.

    Mirrors ``TensorParallelMuon``'s constructor arguments of the same names, plus:

    Attributes:
        ns_method: ``"standard"`` or ``"gram"`` (see the module docstring).
        custom_coefficient_sets: the ``(a, b, c)`` triples when ``coefficient_type == "custom"``
            (cycled through, as ``newton_schulz`` does); must be ``None`` otherwise.
        gram_restarts: Gram NS only: after how many iterations to rebuild ``X`` and ``R`` from the
            accumulated polynomial, each in ``[1, num_ns_steps)``, increasing. ``None`` means
            ``default_gram_restarts(num_ns_steps, gram_half_dtype)``; ``()`` means no restart
            (fine in fp32 for up to ~8 steps, divergent in half precision).
        gram_half_dtype: Gram NS only: its matmul dtype under ``"medium"`` fp32 matmul precision.
    """

    num_ns_steps: int = 5
    coefficient_type: NSCoeffT = "quintic"
    scale_mode: MuonScaleT = "spectral"
    extra_scale_factor: float = 1.0
    ns_method: NSMethodT = "standard"
    custom_coefficient_sets: tuple[CoefficientT, ...] | None = None
    gram_restarts: tuple[int, ...] | None = None
    gram_half_dtype: GramHalfDtypeT = "float16"

    def __post_init__(self) -> None:
        # Lists (from YAML or argparse) become tuples, so the frozen config stays hashable.
        if self.custom_coefficient_sets is not None:
            triples = tuple(tuple(triple) for triple in self.custom_coefficient_sets)
            object.__setattr__(self, "custom_coefficient_sets", triples)
        if self.gram_restarts is not None:
            object.__setattr__(self, "gram_restarts", tuple(self.gram_restarts))
        if self.num_ns_steps < 1:
            raise ValueError(f"num_ns_steps must be at least 1, got {self.num_ns_steps}")
        check_choice("scale_mode", self.scale_mode, MuonScaleT)
        check_choice("ns_method", self.ns_method, NSMethodT)
        # Raises ValueError on an unknown type or a custom type without (valid) triples.
        coefficient_schedule(self.num_ns_steps, self.coefficient_type, self.custom_coefficient_sets)
        if self.coefficient_type != "custom" and self.custom_coefficient_sets is not None:
            raise ValueError(
                "custom_coefficient_sets is only used with coefficient_type='custom', "
                f"got coefficient_type={self.coefficient_type!r}"
            )
        if self.gram_restarts is not None:
            _check_restarts(self.gram_restarts, self.num_ns_steps)
        check_choice("gram_half_dtype", self.gram_half_dtype, GramHalfDtypeT)

    def shape_scale(self, rows: int, cols: int) -> float:
        """Muon's shape-dependent update scale for a ``(rows, cols)`` matrix (without the extra)."""
        return get_muon_scale_factor(rows, cols, mode=self.scale_mode)

    def restarts(self) -> tuple[int, ...]:
        """The Gram restart positions in effect (``gram_restarts`` or the default)."""
        if self.gram_restarts is None:
            return default_gram_restarts(self.num_ns_steps, self.gram_half_dtype)
        return self.gram_restarts

    def gram_compute_dtype(self) -> torch.dtype:
        """Gram NS matmul dtype now: ``gram_half_dtype`` under ``"medium"`` precision, else fp32."""
        if torch.get_float32_matmul_precision() == "medium":
            return getattr(torch, self.gram_half_dtype)
        return torch.float32

    def flops(self, rows: int, cols: int) -> int:
        """``ns_flops`` of a ``(rows, cols)`` matrix under this config's method and restarts."""
        return ns_flops(rows, cols, self.num_ns_steps, self.ns_method, self.restarts())


def coefficient_schedule(
    num_steps: int,
    coefficient_type: NSCoeffT,
    custom_coefficient_sets: Sequence[CoefficientT] | None = None,
) -> list[CoefficientT]:
    """The ``(a, b, c)`` triple of each of ``num_steps`` NS iterations, as ``newton_schulz`` uses.

    Raises:
        ValueError: unknown ``coefficient_type``, or ``"custom"`` without non-empty triples.
    """
    if coefficient_type == "custom":
        if not custom_coefficient_sets:
            raise ValueError("coefficient_type='custom' needs non-empty custom_coefficient_sets")
        sets = [tuple(map(float, triple)) for triple in custom_coefficient_sets]
        if any(len(triple) != 3 for triple in sets):
            raise ValueError(f"custom coefficient sets must be (a, b, c) triples, got {sets}")
    elif coefficient_type in _COEFFICIENT_SETS:
        sets = list(_COEFFICIENT_SETS[coefficient_type])
    else:
        raise ValueError(f"unknown coefficient_type {coefficient_type!r}")
    if coefficient_type in _REPEAT_LAST_TYPES:
        endless = chain(sets, repeat(sets[-1]))
    else:
        endless = cycle(sets)
    return list(islice(endless, num_steps))  # type: ignore[arg-type]


def default_gram_restarts(
    num_steps: int, half_dtype: GramHalfDtypeT = "float16"
) -> tuple[int, ...]:
    """Default Gram restart positions: after iteration 2, then every 3 (fp16) or 2 (bf16) more.

    Five steps with fp16 restart once, after the second, as Gram NS's authors do: the first
    iterations have the largest ``a`` and amplify rounding in ``R`` by ``a^2`` per step, so ``R`` is
    rebuilt from ``X`` before its error outgrows fp16. Longer schedules restart every 3 further
    iterations: without them, 10-step DeepSeek-V4 coefficients diverge even in fp32 on
    ill-conditioned matrices. bf16's 8-bit mantissa needs a restart every 2 iterations
    (tests/test_newton_schulz.py). The schedule does not depend on the run's matmul precision, so
    ``ns_flops`` (the planner's cost model) knows it from the config alone.
    """
    return tuple(range(2, num_steps, 3 if half_dtype == "float16" else 2))


def ns_flops(
    rows: int,
    cols: int,
    num_ns_steps: int,
    ns_method: NSMethodT = "standard",
    gram_restarts: Sequence[int] | None = None,
) -> int:
    """Matmul FLOPs of ``num_ns_steps`` NS iterations on a ``(rows, cols)`` matrix.

    NS works on the smaller side ``k = min(rows, cols)``, ``l = max(rows, cols)``. A standard step
    computes ``A = X X^T`` (2 k^2 l), ``B = bA + cA A`` (2 k^3) and ``X = aX + B X`` (2 k^2 l).

    Gram NS with ``S - 1`` restarts (``S`` segments) computes, per segment, ``R = X X^T`` at its
    start and ``X = Q X`` at its end (2 k^2 l each); per step ``Z = bR + cR R`` (2 k^3), except at a
    segment's first step ``Q = aQ + Q Z`` (2 k^3), and except at its last step
    ``R = (aI + Z) R (aI + Z)`` (two products, 4 k^3): ``4 S k^2 l + 2 k^3 (4 T - 3 S)`` for ``T``
    steps. That is below the standard count iff ``T > S`` and ``l > 1.5 k``; elsewhere Gram NS runs
    (and is charged) the standard iteration.

    Args:
        gram_restarts: Gram only; ``None`` means ``default_gram_restarts(num_ns_steps)`` (fp16).
    """
    k, long = min(rows, cols), max(rows, cols)
    standard = num_ns_steps * (4 * k * k * long + 2 * k * k * k)
    if ns_method == "standard":
        return standard
    if ns_method != "gram":
        raise ValueError(f"ns_method must be 'standard' or 'gram', got {ns_method!r}")
    if gram_restarts is None:
        gram_restarts = default_gram_restarts(num_ns_steps)
    segments = len(gram_restarts) + 1
    gram = 4 * segments * k * k * long + 2 * k * k * k * (4 * num_ns_steps - 3 * segments)
    return min(gram, standard)


def uses_gram(rows: int, cols: int, config: NSConfig) -> bool:
    """Whether ``config`` runs the Gram iteration on a ``(rows, cols)`` matrix (False: standard)."""
    if config.ns_method != "gram":
        return False
    standard = ns_flops(rows, cols, config.num_ns_steps, "standard")
    return config.flops(rows, cols) < standard


def gram_newton_schulz(
    x: torch.Tensor,
    coefficients: Sequence[CoefficientT],
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

    This function always runs the Gram iteration (no FLOPs fallback; ``orthogonalize`` has it).

    Args:
        x: ``(M, N)`` or batched ``(B, M, N)``, fp32; each matrix is orthogonalized on its own.
        coefficients: the ``(a, b, c)`` triple of each iteration (``coefficient_schedule``).
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
    _check_restarts(tuple(restarts), len(coefficients))
    if compute_dtype is None:
        medium = torch.get_float32_matmul_precision() == "medium"
        compute_dtype = torch.float16 if medium else torch.float32

    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    x = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=eps)  # type: ignore[arg-type]
    x = x.to(compute_dtype)

    restart_set = set(restarts)
    last = len(coefficients) - 1
    gram = x @ x.mT
    q: torch.Tensor | None = None
    for step, (a, b, c) in enumerate(coefficients):
        if step in restart_set:
            x = q @ x  # type: ignore[operator]
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
    x = (q @ x).to(torch.float32)  # type: ignore[operator]
    return x.mT if transpose else x


def orthogonalize(x: torch.Tensor, config: NSConfig) -> torch.Tensor:
    """NS of a 2-D ``(M, N)`` or 3-D ``(B, M, N)`` fp32 tensor by ``config``'s method (no scale).

    The Gram method falls back to the standard iteration on shapes where it would not save FLOPs
    (``uses_gram``); the standard method is emerging-optimizers' ``newton_schulz`` itself.
    """
    rows, cols = x.shape[-2], x.shape[-1]
    if uses_gram(rows, cols, config):
        schedule = coefficient_schedule(
            config.num_ns_steps, config.coefficient_type, config.custom_coefficient_sets
        )
        return gram_newton_schulz(
            x, schedule, config.restarts(), compute_dtype=config.gram_compute_dtype()
        )
    custom = None
    if config.custom_coefficient_sets is not None:
        custom = [tuple(triple) for triple in config.custom_coefficient_sets]
    return newton_schulz(
        x, config.num_ns_steps, config.coefficient_type, custom_coefficient_sets=custom
    )


def orthogonalize_batch(matrices: Sequence[torch.Tensor], config: NSConfig) -> list[torch.Tensor]:
    """Orthogonalizes same-shape fp32 matrices in one batched NS call, then scales each.

    Args:
        matrices: ``B`` tensors of one shape ``(M, N)``, fp32, plain (not DTensor).
        config: NS method, steps, coefficients and scale.

    Returns:
        ``B`` tensors ``(M, N)``: ``NS(m) * scale(M, N)``. A single matrix takes the 2-D path so
        its result is bitwise the one ``TensorParallelMuon`` computes (standard method).
    """
    if not matrices:
        return []
    rows, cols = matrices[0].shape
    if len(matrices) == 1:
        return [scaled_orthogonalize(matrices[0], config)]
    stacked = torch.stack(list(matrices))
    orthogonal = _scale_inplace(orthogonalize(stacked, config), rows, cols, config)
    return list(orthogonal.unbind(0))


def scaled_orthogonalize(matrix: torch.Tensor, config: NSConfig) -> torch.Tensor:
    """``NS(matrix) * scale`` for a 2-D ``(M, N)`` or 3-D ``(B, M, N)`` fp32 tensor."""
    rows, cols = matrix.shape[-2], matrix.shape[-1]
    return _scale_inplace(orthogonalize(matrix, config), rows, cols, config)


def _scale_inplace(
    orthogonal: torch.Tensor, rows: int, cols: int, config: NSConfig
) -> torch.Tensor:
    """Muon's scale, applied in place to NS's fresh output: two multiplications in
    ``TensorParallelMuon``'s order (``x * scale * extra``), so results match it bitwise, without
    allocating two more matrices."""
    orthogonal.mul_(config.shape_scale(rows, cols))
    if config.extra_scale_factor != 1.0:
        orthogonal.mul_(config.extra_scale_factor)
    return orthogonal


def _addmm(
    input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: float, alpha: float
) -> torch.Tensor:
    """``beta * input + alpha * mat1 @ mat2``, 2-D (``addmm``) or batched 3-D (``baddbmm``)."""
    if mat1.ndim == 2:
        return torch.addmm(input, mat1, mat2, beta=beta, alpha=alpha)
    return torch.baddbmm(input, mat1, mat2, beta=beta, alpha=alpha)


def _check_restarts(restarts: tuple[int, ...], num_steps: int) -> None:
    """Raises ValueError unless ``restarts`` is increasing and inside ``[1, num_steps)``."""
    if any(not 1 <= r < num_steps for r in restarts) or list(restarts) != sorted(set(restarts)):
        raise ValueError(
            f"gram restarts must be increasing iteration counts in [1, {num_steps}), got {restarts}"
        )

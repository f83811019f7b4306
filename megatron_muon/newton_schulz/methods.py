"""Newton-Schulz (NS) orthogonalization: the methods, their configuration and their FLOP cost.

Every NS method computes the same polynomial of a matrix ``X`` (``(k, l)`` after transposing so
that ``k <= l``), step ``t`` being ``X <- (a_t I + b_t X X^T + c_t (X X^T)^2) X``. The methods are
the entries of one registry, ``NS_METHODS`` (name -> how to run it, its FLOP count, whether
``split_newton_schulz`` can split it over ranks); ``NSMethodT`` lists the same names, so that the
config, the CLI choices and the planner's cost all follow from this file:

- ``"standard"``: emerging-optimizers' ``newton_schulz`` (the code megatron-core's
  ``TensorParallelMuon`` runs), iterating on ``X`` itself;
- ``"gram"``: Gram Newton-Schulz (``gram_newton_schulz``), iterating on the small ``(k, k)`` Gram
  matrix. Where it would not save FLOPs (near-square matrices) it runs the standard iteration
  instead, so its cost is never above the standard count;
- ``"symmetric"``: the standard iteration with its symmetric products ``X X^T`` and
  ``(X X^T)^2`` computed as three of their four blocks (``symmetric_newton_schulz``): 12 to 17%
  fewer FLOPs, results equal to the standard method's to fp32 reduction order.

Around the iteration, this module adds what a sharded optimizer needs:

- ``orthogonalize_batch``: same-shape matrices orthogonalized in one batched NS call;
- ``scaled_orthogonalize``: NS followed by Muon's scale factor, exactly as ``TensorParallelMuon``'s
  ``scaled_orthogonalize_fn`` computes it for an untensor-parallel matrix;
- ``ns_flops`` / ``NSConfig.flops``: the matmul FLOPs NS performs on a matrix, the cost model of
  the owner planner (``cost_model``).

Coefficients: every emerging-optimizers ``NSCoeffT`` set (``simple``, ``quintic``,
``polar_express``, ``cans``, ``aol``, ``deepseekv4``, ``custom``) works with every method and with
the same schedule: ``polar_express``, ``cans`` and ``deepseekv4`` repeat their last triple past the
end of the list, the others (and ``custom``) cycle through it (``coefficient_schedule``).

Precision. Inputs are plain ``torch.Tensor`` (never DTensor), fp32, 2-D ``(M, N)`` or 3-D
``(B, M, N)``; results are fp32. When ``torch.get_float32_matmul_precision() == "medium"``
(Megatron's default ``--muon-fp32-matmul-prec``), the standard method runs its matmuls in bf16 (as
``newton_schulz`` does) and the Gram method in ``NSConfig.gram_half_dtype`` (fp16 by default; most
CPUs emulate fp16 GEMMs slowly: choose ``"bfloat16"`` there). Measured accuracy of the methods and
dtypes: docs/newton_schulz.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, cycle, islice, repeat
from typing import Literal, get_args

import torch
from emerging_optimizers.orthogonalized_optimizers.muon import get_muon_scale_factor
from emerging_optimizers.orthogonalized_optimizers.muon_utils import (
    _COEFFICIENT_SETS,
    NSCoeffT,
    newton_schulz,
)

from megatron_muon.common.options import GramHalfDtypeT, MuonScaleT, check_choice
from megatron_muon.newton_schulz.gram import (
    check_restarts,
    default_gram_restarts,
    gram_newton_schulz,
    gram_ns_flops,
)
from megatron_muon.newton_schulz.symmetric import symmetric_newton_schulz, symmetric_ns_flops
from megatron_muon.newton_schulz.syrk import syrk_newton_schulz

__all__ = [
    "NS_METHODS",
    "NSConfig",
    "NSMethod",
    "NSMethodT",
    "coefficient_schedule",
    "ns_flops",
    "orthogonalize",
    "orthogonalize_batch",
    "scaled_orthogonalize",
    "uses_gram",
]

CoefficientT = tuple[float, float, float]

# The sets that newton_schulz extends by repeating their last triple; all others cycle. This mirrors
# a local tuple inside emerging-optimizers' newton_schulz (no public name); the test
# test_schedule_reproduces_emerging_newton_schulz pins the two together bitwise.
_REPEAT_LAST_TYPES: frozenset[str] = frozenset({"polar_express", "cans", "deepseekv4"})


# --------------------------------------------------------------------------------------------------
# The NS-method registry: a new method is a name in NSMethodT and one entry in NS_METHODS.
# --------------------------------------------------------------------------------------------------

NSMethodT = Literal["standard", "gram", "symmetric"]
# The default NS method everywhere (ShardedMuon, the flags, the plan tool): the iteration
# megatron-core's TensorParallelMuon runs, so that ours equals it bitwise.
DEFAULT_NS_METHOD: NSMethodT = "standard"


@dataclass(frozen=True, slots=True)
class NSMethod:
    """One NS method.

    Attributes:
        run: NS (without Muon's scale) of a 2-D ``(M, N)`` or batched 3-D ``(B, M, N)`` fp32
            tensor under a config; returns fp32 of the same shape.
        flops: matmul FLOPs of ``run`` on one ``(rows, cols)`` matrix under a config.
        splittable: ``split_newton_schulz`` implements the method, so the planner may split one
            matrix's NS over a block of ranks.
    """

    run: Callable[[torch.Tensor, NSConfig], torch.Tensor]
    flops: Callable[[int, int, NSConfig], int]
    splittable: bool


def _standard(x: torch.Tensor, config: NSConfig) -> torch.Tensor:
    custom = None
    if config.custom_coefficient_sets is not None:
        custom = [tuple(triple) for triple in config.custom_coefficient_sets]
    if config.use_syrk:
        return syrk_newton_schulz(x, config.num_ns_steps, config.coefficient_type, custom)
    return newton_schulz(
        x, config.num_ns_steps, config.coefficient_type, custom_coefficient_sets=custom
    )


def _standard_flops(rows: int, cols: int, config: NSConfig) -> int:
    """Per step ``A = X X^T`` (2 k^2 l), ``B = bA + cA A`` (2 k^3) and ``X = aX + B X`` (2 k^2 l),
    with ``k = min(rows, cols)``, ``l = max(rows, cols)``."""
    k, long = min(rows, cols), max(rows, cols)
    return config.num_ns_steps * (4 * k * k * long + 2 * k * k * k)


def _gram(x: torch.Tensor, config: NSConfig) -> torch.Tensor:
    if not uses_gram(x.shape[-2], x.shape[-1], config):
        return _standard(x, config)
    schedule = coefficient_schedule(
        config.num_ns_steps, config.coefficient_type, config.custom_coefficient_sets
    )
    return gram_newton_schulz(
        x, schedule, config.restarts(), compute_dtype=config.gram_compute_dtype()
    )


def _gram_flops(rows: int, cols: int, config: NSConfig) -> int:
    gram = gram_ns_flops(rows, cols, config.num_ns_steps, config.restarts())
    return min(gram, _standard_flops(rows, cols, config))


def _symmetric(x: torch.Tensor, config: NSConfig) -> torch.Tensor:
    schedule = coefficient_schedule(
        config.num_ns_steps, config.coefficient_type, config.custom_coefficient_sets
    )
    return symmetric_newton_schulz(x, schedule)


def _symmetric_flops(rows: int, cols: int, config: NSConfig) -> int:
    return symmetric_ns_flops(rows, cols, config.num_ns_steps)


NS_METHODS: dict[str, NSMethod] = {
    "standard": NSMethod(run=_standard, flops=_standard_flops, splittable=True),
    "gram": NSMethod(run=_gram, flops=_gram_flops, splittable=False),
    "symmetric": NSMethod(run=_symmetric, flops=_symmetric_flops, splittable=False),
}
assert set(NS_METHODS) == set(get_args(NSMethodT)), "NSMethodT and NS_METHODS name the same methods"


@dataclass(frozen=True, slots=True)
class NSConfig:
    """How a matrix is orthogonalized: NS method and coefficients, plus Muon's update scale.

    Mirrors ``TensorParallelMuon``'s constructor arguments of the same names, plus:

    Attributes:
        ns_method: a method of the registry ``NS_METHODS`` (see the module docstring).
        custom_coefficient_sets: the ``(a, b, c)`` triples when ``coefficient_type == "custom"``
            (cycled through, as ``newton_schulz`` does); must be ``None`` otherwise.
        gram_restarts: Gram NS only: after how many iterations to rebuild ``X`` and ``R`` from the
            accumulated polynomial, each in ``[1, num_ns_steps)``, increasing. ``None`` means
            ``default_gram_restarts(num_ns_steps, gram_half_dtype)``; ``()`` means no restart
            (fine in fp32 for up to ~8 steps, divergent in half precision).
        gram_half_dtype: Gram NS only: its matmul dtype under ``"medium"`` fp32 matmul precision.
        use_syrk: the standard method through emerging-optimizers' Triton syrk kernels
            (``newton_schulz.syrk``; CUDA only: whoever builds the optimizer checks
            ``syrk_problem`` for its device).
    """

    num_ns_steps: int = 5
    coefficient_type: NSCoeffT = "quintic"
    scale_mode: MuonScaleT = "spectral"
    extra_scale_factor: float = 1.0
    ns_method: NSMethodT = DEFAULT_NS_METHOD
    custom_coefficient_sets: tuple[CoefficientT, ...] | None = None
    gram_restarts: tuple[int, ...] | None = None
    gram_half_dtype: GramHalfDtypeT = "float16"
    use_syrk: bool = False

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
            check_restarts(self.gram_restarts, self.num_ns_steps)
        check_choice("gram_half_dtype", self.gram_half_dtype, GramHalfDtypeT)
        if self.use_syrk and self.ns_method != "standard":
            raise ValueError(
                "use_syrk runs the standard Newton-Schulz iteration through Triton syrk kernels; "
                f"ns_method={self.ns_method!r} has no syrk form"
            )

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
        """Matmul FLOPs of this config's NS on a ``(rows, cols)`` matrix (its method's cost)."""
        return NS_METHODS[self.ns_method].flops(rows, cols, self)

    @property
    def splittable(self) -> bool:
        """Whether ``split_newton_schulz`` can run this NS over a block of ranks: a method that
        it implements, with a built-in coefficient set."""
        return NS_METHODS[self.ns_method].splittable and self.coefficient_type != "custom"

    @property
    def is_tensor_parallel_muons(self) -> bool:
        """Whether this is the NS ``TensorParallelMuon`` runs itself (the standard method, a
        built-in coefficient set), so that its tensor-parallel NS can stand in for it."""
        return self.ns_method == "standard" and self.custom_coefficient_sets is None


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
    endless: Iterator[tuple[float, ...]]
    if coefficient_type in _REPEAT_LAST_TYPES:
        endless = chain(sets, repeat(sets[-1]))
    else:
        endless = cycle(sets)
    return [(a, b, c) for a, b, c in islice(endless, num_steps)]


def ns_flops(
    rows: int,
    cols: int,
    num_ns_steps: int,
    ns_method: NSMethodT = DEFAULT_NS_METHOD,
    gram_restarts: Sequence[int] | None = None,
) -> int:
    """Matmul FLOPs of ``num_ns_steps`` NS iterations of ``ns_method`` on a ``(rows, cols)`` matrix.

    Args:
        gram_restarts: Gram only; ``None`` means ``default_gram_restarts(num_ns_steps)`` (fp16).
    """
    restarts = None if gram_restarts is None else tuple(gram_restarts)
    config = NSConfig(num_ns_steps=num_ns_steps, ns_method=ns_method, gram_restarts=restarts)
    return config.flops(rows, cols)


def uses_gram(rows: int, cols: int, config: NSConfig) -> bool:
    """Whether ``config`` runs the Gram iteration on a ``(rows, cols)`` matrix (False: standard):
    the Gram method, where it needs fewer FLOPs than the standard iteration."""
    if config.ns_method != "gram":
        return False
    gram = gram_ns_flops(rows, cols, config.num_ns_steps, config.restarts())
    return gram < _standard_flops(rows, cols, config)


def orthogonalize(x: torch.Tensor, config: NSConfig) -> torch.Tensor:
    """NS of a 2-D ``(M, N)`` or 3-D ``(B, M, N)`` fp32 tensor by ``config``'s method (no scale)."""
    return NS_METHODS[config.ns_method].run(x, config)


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

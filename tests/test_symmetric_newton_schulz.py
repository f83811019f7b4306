"""Symmetric Newton-Schulz (``ns_method="symmetric"``): the standard iteration with its symmetric
products computed by halves, against the float64 polynomial and against standard NS.

Accuracy is the max deviation of singular values from a float64 evaluation of the same NS
polynomial (``tests.newton_schulz_reference.float64_polynomial``), compared with what standard NS
itself achieves in the same precision on the same input: the noise floor is measured in each test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

from megatron_muon.newton_schulz.methods import NSConfig, ns_flops, orthogonalize
from tests.newton_schulz_reference import (
    SCHEDULES,
    float64_polynomial,
    schedule_of,
    spread_matrix,
    sv_deviation,
)

# Odd short sides too: the halves are ceil(k / 2) and floor(k / 2) rows.
SHAPES = [(48, 192), (192, 48), (41, 320), (40, 40), (3, 33, 160), (3, 160, 33), (1, 7)]


@pytest.fixture(autouse=True)
def _restore_precision() -> Iterator[None]:
    previous = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(previous)


def _inputs(shape: tuple[int, ...]) -> list[torch.Tensor]:
    """A Gaussian matrix and one with singular values spread over [1e-6, 1]."""
    gaussian = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    return [gaussian, spread_matrix(shape, -6.0, seed=2)]


@pytest.mark.parametrize("precision", ["highest", "medium"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("coefficient_type", "steps"), SCHEDULES, ids=str)
def test_symmetric_is_as_close_to_the_float64_polynomial_as_standard(
    coefficient_type: str, steps: int, shape: tuple[int, ...], precision: str
) -> None:
    """Symmetric NS's error is standard NS's own error in the same precision, up to 2x.

    Tolerance: both evaluate the same polynomial with the same coefficients, normalization and
    matmul dtype (fp32 under "highest", bf16 under "medium"); only the summation order inside the
    blocked products differs, so symmetric NS's deviation from float64 is bounded by standard NS's
    (measured at most 1.42x in fp32, 1.0x in bf16) times 2, plus 1e-6 for inputs on which standard
    NS happens to be exact (a few fp32 ulps of the unit-scale result).
    """
    torch.set_float32_matmul_precision(precision)
    schedule = schedule_of(coefficient_type, steps)
    config = NSConfig(num_ns_steps=steps, coefficient_type=coefficient_type, ns_method="symmetric")
    for x in _inputs(shape):
        reference = float64_polynomial(x, schedule)
        standard = newton_schulz(x, steps, "custom", custom_coefficient_sets=schedule)
        symmetric = orthogonalize(x, config)
        standard_dev = sv_deviation(standard, reference)
        symmetric_dev = sv_deviation(symmetric, reference)
        assert symmetric.shape == x.shape and symmetric.dtype == torch.float32
        assert symmetric_dev <= 2 * standard_dev + 1e-6, (symmetric_dev, standard_dev)


def test_symmetric_saves_a_quarter_of_the_symmetric_products() -> None:
    """Per step 3.5 k^2 l + 1.5 k^3 against 4 k^2 l + 2 k^3 FLOPs (even k)."""
    assert ns_flops(512, 2048, 5, "symmetric") / ns_flops(512, 2048, 5) == pytest.approx(31 / 36)
    assert ns_flops(2048, 512, 5, "symmetric") == ns_flops(512, 2048, 5, "symmetric")
    assert ns_flops(512, 512, 5, "symmetric") / ns_flops(512, 512, 5) == pytest.approx(5 / 6)
    assert ns_flops(1, 7, 5, "symmetric") == ns_flops(1, 7, 5)


def test_symmetric_refuses_non_float32_input() -> None:
    with pytest.raises(TypeError, match="float32"):
        orthogonalize(torch.randn(4, 8, dtype=torch.float64), NSConfig(ns_method="symmetric"))

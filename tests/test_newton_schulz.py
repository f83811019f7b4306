"""Newton-Schulz methods: Gram NS against the standard iteration, coefficient schedules, FLOPs.

Accuracy is measured against a float64 evaluation of the same NS polynomial
(``tests.newton_schulz_reference.float64_polynomial``), so a tolerance can be stated relative to
what fp32 (or bf16) standard NS itself achieves. Deviations are the max over singular values of
|sv(result) - sv(reference)| (the quantity Muon's update depends on) and are printed
(``pytest -s``) for the report.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz
from torch.utils.flop_counter import FlopCounterMode

from megatron_muon.newton_schulz.gram import default_gram_restarts, gram_newton_schulz
from megatron_muon.newton_schulz.methods import (
    NSConfig,
    ns_flops,
    orthogonalize,
    orthogonalize_batch,
    scaled_orthogonalize,
    uses_gram,
)
from tests.newton_schulz_reference import (
    CUSTOM,
    SCHEDULES,
    float64_polynomial,
    schedule_of,
    spread_matrix,
    sv_deviation,
)

SHAPES = [(48, 192), (192, 48), (40, 320), (3, 32, 160), (3, 160, 32)]


@pytest.fixture(autouse=True)
def _highest_precision() -> Iterator[None]:
    """fp32 matmuls stay fp32 (no TF32 / bf16) unless a test says otherwise."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("steps", [3, 5, 12])
@pytest.mark.parametrize(
    "coefficient_type",
    ["simple", "quintic", "polar_express", "cans", "aol", "deepseekv4", "custom"],
)
def test_schedule_reproduces_emerging_newton_schulz(coefficient_type: str, steps: int) -> None:
    """Our (a, b, c) per step, replayed through newton_schulz, is bitwise its own schedule."""
    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    custom = [tuple(t) for t in CUSTOM] if coefficient_type == "custom" else None
    expected = newton_schulz(x, steps, coefficient_type, custom_coefficient_sets=custom)
    replayed = newton_schulz(
        x, steps, "custom", custom_coefficient_sets=schedule_of(coefficient_type, steps)
    )
    torch.testing.assert_close(replayed, expected, atol=0, rtol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("coefficient_type", "steps"), [*SCHEDULES, ("custom", 6)], ids=str)
def test_gram_matches_standard_fp32(
    coefficient_type: str, steps: int, shape: tuple[int, ...]
) -> None:
    """fp32 Gram NS is as close to the float64 polynomial as fp32 standard NS, up to a small factor.

    Tolerance: both methods evaluate the same polynomial and differ only in rounding order, so
    Gram's error is bounded relative to standard NS's own fp32 error: at most 10x it, plus 2e-5
    absolute. The absolute term covers matrices where standard NS happens to be almost exact: the
    composite polynomial's slope near 0 is the product of the a_t (~1e3 for Polar Express), so
    singular values ~1e-4 of the normalized input carry rounding of ~1e-7 * 1e3 in the output.
    Inputs: a Gaussian matrix and one with singular values spread over [1e-6, 1].
    """
    schedule = schedule_of(coefficient_type, steps)
    config = NSConfig(
        num_ns_steps=steps,
        coefficient_type=coefficient_type,
        custom_coefficient_sets=CUSTOM if coefficient_type == "custom" else None,
        ns_method="gram",
    )
    assert uses_gram(shape[-2], shape[-1], config)
    gaussian = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    for x in (gaussian, spread_matrix(shape, -6.0, seed=2)):
        reference = float64_polynomial(x, schedule)
        standard = newton_schulz(x, steps, "custom", custom_coefficient_sets=schedule)
        gram = orthogonalize(x, config)
        standard_dev = sv_deviation(standard, reference)
        gram_dev = sv_deviation(gram, reference)
        between = sv_deviation(gram, standard)
        print(
            f"\n[gram fp32] {coefficient_type}/{steps} {shape}: max sv deviation gram-vs-standard "
            f"{between:.2e} (gram-vs-f64 {gram_dev:.2e}, standard-vs-f64 {standard_dev:.2e})"
        )
        assert gram.shape == x.shape and gram.dtype == torch.float32
        assert gram_dev <= 10 * standard_dev + 2e-5, (gram_dev, standard_dev)


@pytest.mark.parametrize("shape", [(64, 64), (64, 96), (96, 64), (2, 80, 80)], ids=str)
def test_gram_falls_back_to_standard_where_it_saves_no_flops(shape: tuple[int, ...]) -> None:
    """Long side <= 1.5x short side: Gram NS costs at least standard NS, so it runs standard NS.

    With T steps and S restart segments, Gram saves FLOPs iff T > S and l > 1.5 k (ns_flops).
    """
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    config = NSConfig(ns_method="gram")
    assert not uses_gram(shape[-2], shape[-1], config)
    assert config.flops(shape[-2], shape[-1]) == ns_flops(shape[-2], shape[-1], 5)
    torch.testing.assert_close(orthogonalize(x, config), newton_schulz(x, 5), atol=0, rtol=0)


def test_gram_runs_just_above_the_break_even_aspect_ratio() -> None:
    """65 x 98 (ratio 1.51) is the first shape past 1.5 that Gram NS takes."""
    config = NSConfig(ns_method="gram")
    assert uses_gram(65, 98, config) and uses_gram(98, 65, config)
    assert not uses_gram(64, 96, config)
    assert config.flops(65, 98) < ns_flops(65, 98, 5)


def test_gram_with_a_restart_after_every_step_is_standard_ns() -> None:
    """Restarting after every step costs exactly standard NS, so it falls back (bitwise)."""
    config = NSConfig(num_ns_steps=4, ns_method="gram", gram_restarts=(1, 2, 3))
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(4))
    assert ns_flops(32, 256, 4, "gram", (1, 2, 3)) == ns_flops(32, 256, 4)
    assert not uses_gram(32, 256, config)
    torch.testing.assert_close(orthogonalize(x, config), newton_schulz(x, 4), atol=0, rtol=0)


def test_standard_method_is_bitwise_emerging_newton_schulz() -> None:
    """The default config keeps the lead's semantics: newton_schulz itself, then the scale."""
    x = torch.randn(48, 160, generator=torch.Generator().manual_seed(5))
    config = NSConfig()
    expected = newton_schulz(x, 5, "quintic") * config.shape_scale(48, 160) * 1.0
    torch.testing.assert_close(scaled_orthogonalize(x, config), expected, atol=0, rtol=0)
    torch.testing.assert_close(orthogonalize_batch([x], config)[0], expected, atol=0, rtol=0)


def test_orthogonalize_batch_with_gram_matches_each_matrix() -> None:
    """Batched Gram NS (baddbmm) equals per-matrix Gram NS (addmm) up to fp32 rounding."""
    generator = torch.Generator().manual_seed(6)
    matrices = [torch.randn(40, 200, generator=generator) for _ in range(3)]
    config = NSConfig(ns_method="gram", coefficient_type="polar_express", extra_scale_factor=0.5)
    batched = orthogonalize_batch(matrices, config)
    for matrix, result in zip(matrices, batched, strict=True):
        torch.testing.assert_close(result, scaled_orthogonalize(matrix, config), atol=1e-5, rtol=0)


# (coefficient_type, steps, low exponent of the singular values): bf16 needs its own restarts.
HALF_CASES = [
    ("quintic", 5, -6.0),
    ("quintic", 5, -3.0),
    ("polar_express", 5, -6.0),
    ("polar_express", 8, -4.0),
    ("simple", 5, -8.0),
    ("aol", 4, -5.0),
]


@pytest.mark.parametrize(("coefficient_type", "steps", "low_exponent"), HALF_CASES, ids=str)
def test_half_precision_gram_with_restarts_is_as_accurate_as_bf16_standard(
    coefficient_type: str, steps: int, low_exponent: float
) -> None:
    """Under "medium" matmul precision: fp16 and bf16 Gram NS (default restarts) vs bf16 standard.

    bf16 standard NS (what ``--muon-fp32-matmul-prec medium`` runs) is the bar: its deviation from
    the float64 polynomial on these spread spectra is 2e-2..0.6 (singular values below bf16's
    resolution come out anywhere in the polynomial's range). Each half-precision Gram variant
    must stay within 1.25x that plus 1e-2 (measured: fp16 Gram with a restart per 3 steps is 5-10x
    better than bf16 standard, bf16 Gram with a restart every 2 steps about equal).
    """
    x = spread_matrix((2, 64, 320), low_exponent, seed=7)
    schedule = schedule_of(coefficient_type, steps)
    reference = float64_polynomial(x, schedule)
    configs = {
        half: NSConfig(
            num_ns_steps=steps,
            coefficient_type=coefficient_type,
            ns_method="gram",
            gram_half_dtype=half,
        )
        for half in ("float16", "bfloat16")
    }
    torch.set_float32_matmul_precision("medium")
    bf16_standard = sv_deviation(newton_schulz(x, steps, coefficient_type), reference)
    fp16_gram = sv_deviation(orthogonalize(x, configs["float16"]), reference)
    bf16_gram = sv_deviation(orthogonalize(x, configs["bfloat16"]), reference)
    print(
        f"\n[half] {coefficient_type}/{steps} sv in [1e{low_exponent:.0f}, 1]: max sv deviation "
        f"vs f64: bf16 standard {bf16_standard:.2e}, fp16 gram (restarts "
        f"{configs['float16'].restarts()}) {fp16_gram:.2e}, bf16 gram (restarts "
        f"{configs['bfloat16'].restarts()}) {bf16_gram:.2e}"
    )
    assert fp16_gram <= 1.25 * bf16_standard + 1e-2
    assert bf16_gram <= 1.25 * bf16_standard + 1e-2


def test_medium_precision_selects_the_gram_half_dtype() -> None:
    """ "medium" runs Gram NS in gram_half_dtype (bitwise the explicit call); "highest" in fp32."""
    x = torch.randn(32, 160, generator=torch.Generator().manual_seed(10))
    schedule = schedule_of("quintic", 5)
    for half, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        config = NSConfig(ns_method="gram", gram_half_dtype=half)
        explicit = gram_newton_schulz(x, schedule, config.restarts(), compute_dtype=dtype)
        torch.set_float32_matmul_precision("medium")
        torch.testing.assert_close(orthogonalize(x, config), explicit, atol=0, rtol=0)
        torch.set_float32_matmul_precision("highest")
        fp32 = gram_newton_schulz(x, schedule, config.restarts(), compute_dtype=torch.float32)
        torch.testing.assert_close(orthogonalize(x, config), fp32, atol=0, rtol=0)


def test_bf16_gram_without_enough_restarts_diverges() -> None:
    """Why restarts exist: rounding pushes tiny eigenvalues of R below 0 and the polynomial,
    applied to R without ever looking at X again, blows them up (a^2 growth per step). In bf16,
    no restart (5 steps) and fp16's schedule (8 steps: after 2 and 5) both diverge; a restart
    every 2 steps does not."""
    x = spread_matrix((64, 320), -6.0, seed=8)
    for steps, too_few in ((5, ()), (8, default_gram_restarts(8, "float16"))):
        schedule = schedule_of("polar_express", steps)
        reference = float64_polynomial(x, schedule)
        enough = default_gram_restarts(steps, "bfloat16")
        deviations = [
            sv_deviation(
                gram_newton_schulz(x, schedule, restarts, compute_dtype=torch.bfloat16), reference
            )
            for restarts in (too_few, enough)
        ]
        print(
            f"\n[half] bf16 gram polar_express/{steps}: restarts {too_few} {deviations[0]:.2e}, "
            f"{enough} {deviations[1]:.2e}"
        )
        assert deviations[0] > 10 and deviations[1] < 1


def test_fp32_gram_needs_restarts_on_long_schedules() -> None:
    """10 DeepSeek-V4 steps (a = 3.44 eight times) amplify fp32 rounding in R past recovery
    without restarts; the default restarts (2, 5, 8) keep Gram NS at standard NS's accuracy."""
    x = spread_matrix((128, 512), -6.0, seed=9)
    schedule = schedule_of("deepseekv4", 10)
    reference = float64_polynomial(x, schedule)
    standard = sv_deviation(newton_schulz(x, 10, "deepseekv4"), reference)
    no_restart = sv_deviation(gram_newton_schulz(x, schedule, ()), reference)
    default = sv_deviation(gram_newton_schulz(x, schedule, default_gram_restarts(10)), reference)
    print(
        f"\n[fp32] deepseekv4/10: no restart {no_restart:.2e}, default {default:.2e}, "
        f"standard {standard:.2e}"
    )
    assert no_restart > 1e-2
    assert default <= 10 * standard + 2e-5


@pytest.mark.parametrize("restarts", [None, (), (1,), (2, 3)], ids=str)
@pytest.mark.parametrize(
    "shape", [(24, 96), (96, 24), (2, 16, 128), (40, 40), (1, 30, 50)], ids=str
)
def test_ns_flops_counts_the_matmuls_performed(
    shape: tuple[int, ...], restarts: tuple[int, ...] | None
) -> None:
    """ns_flops equals the FLOPs torch's FlopCounterMode counts (mm, addmm, bmm, baddbmm)."""
    x = torch.randn(*shape)
    batch = shape[0] if len(shape) == 3 else 1
    rows, cols = shape[-2], shape[-1]
    for method in ("standard", "gram", "symmetric"):
        config = NSConfig(num_ns_steps=5, ns_method=method, gram_restarts=restarts)
        with FlopCounterMode(display=False) as counter:
            orthogonalize(x, config)
        assert counter.get_total_flops() == batch * config.flops(rows, cols), (method, restarts)
    schedule = schedule_of("quintic", 5)
    with FlopCounterMode(display=False) as counter:
        gram_newton_schulz(x, schedule, restarts or ())
    k, long = min(rows, cols), max(rows, cols)
    segments = len(restarts or ()) + 1
    expected = 4 * segments * k * k * long + 2 * k**3 * (4 * 5 - 3 * segments)
    assert counter.get_total_flops() == batch * expected


def test_gram_flops_savings_by_aspect_ratio() -> None:
    """5 steps, one restart: Gram needs (8a + 28) k^3 vs (20a + 10) k^3 for aspect ratio a."""
    assert ns_flops(512, 2048, 5, "gram") / ns_flops(512, 2048, 5) == pytest.approx(60 / 90)
    assert ns_flops(512, 4096, 5, "gram") / ns_flops(512, 4096, 5) == pytest.approx(92 / 170)
    assert ns_flops(512, 512, 5, "gram") == ns_flops(512, 512, 5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ns_method": "fast"}, "ns_method"),
        ({"coefficient_type": "nope"}, "coefficient_type"),
        ({"coefficient_type": "custom"}, "custom_coefficient_sets"),
        ({"custom_coefficient_sets": CUSTOM}, "only used with"),
        ({"custom_coefficient_sets": ((1.0, 2.0),), "coefficient_type": "custom"}, "triples"),
        ({"gram_restarts": (0,)}, "restarts"),
        ({"gram_restarts": (5,)}, "restarts"),
        ({"gram_restarts": (3, 2)}, "restarts"),
        ({"num_ns_steps": 0}, "num_ns_steps"),
        ({"gram_half_dtype": "float8"}, "gram_half_dtype"),
    ],
    ids=str,
)
def test_config_rejects_bad_values(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NSConfig(**kwargs)  # type: ignore[arg-type]  # bad values on purpose


def test_default_gram_restarts() -> None:
    assert default_gram_restarts(1) == ()
    assert default_gram_restarts(5) == (2,)
    assert default_gram_restarts(8) == (2, 5)
    assert default_gram_restarts(10) == (2, 5, 8)
    assert default_gram_restarts(5, "bfloat16") == (2, 4)
    assert default_gram_restarts(8, "bfloat16") == (2, 4, 6)
    assert NSConfig(ns_method="gram", gram_half_dtype="bfloat16").restarts() == (2, 4)
    assert NSConfig(ns_method="gram", gram_restarts=(1,)).restarts() == (1,)


def test_config_from_lists_is_hashable() -> None:
    """Lists from YAML / argparse are stored as tuples (the config is frozen and hashable)."""
    config = NSConfig(
        coefficient_type="custom",
        custom_coefficient_sets=[[3.0, -3.2, 1.2]],  # type: ignore[arg-type]  # lists on purpose (as YAML gives them)
        gram_restarts=[2],  # type: ignore[arg-type]  # a list on purpose
    )
    assert config.custom_coefficient_sets == ((3.0, -3.2, 1.2),)
    assert config.gram_restarts == (2,)
    hash(config)

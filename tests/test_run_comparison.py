"""tests/run_comparison.py's verdict, on made-up series (one process, no launch): it fails where
a difference exceeds the factor times the floor's envelope up to that iteration plus the guard,
even when the floor grows larger later, and a floor of exactly 0 leaves the guard."""

from __future__ import annotations

import pytest

from tests.run_comparison import FloorVerdict, assert_within_floor, relative_differences

REFERENCE = {1: 4.0, 2: 4.0, 3: 4.0, 4: 4.0}


def _series(relative: list[float]) -> dict[int, float]:
    """The reference moved by ``relative`` at each iteration."""
    return {i: value * (1 + r) for (i, value), r in zip(REFERENCE.items(), relative, strict=True)}


def test_a_difference_within_the_floor_passes_and_reports_it() -> None:
    verdict = assert_within_floor(
        "x",
        _series([0, 1e-6, 1e-5, 1e-4]),
        REFERENCE,
        _series([0, 1e-6, 2e-6, 5e-5]),
        guard=1e-7,
    )
    assert verdict.failing == []
    assert verdict.bounds[3] == pytest.approx(10 * 2e-6 + 1e-7)
    assert "largest difference 1.00e-04" in str(verdict)


def test_a_difference_ahead_of_the_floors_growth_fails_although_the_floor_grows_later() -> None:
    # Iteration 2: 1e-4 against a floor of 1e-7 so far; the floor's 1e-3 at iteration 4 does not
    # excuse it (a lost update shows at once; amplified rounding grows).
    with pytest.raises(AssertionError, match=r"over the floor at iterations \[2\]"):
        assert_within_floor(
            "x", _series([0, 1e-4, 1e-4, 1e-4]), REFERENCE, _series([0, 1e-7, 1e-5, 1e-3]), guard=0
        )


def test_a_floor_of_zero_leaves_the_guard() -> None:
    assert_within_floor("x", _series([0, 1e-7, 0, 0]), REFERENCE, REFERENCE, guard=2e-7)
    with pytest.raises(AssertionError, match=r"iterations \[2\]"):
        assert_within_floor("x", _series([0, 1e-6, 0, 0]), REFERENCE, REFERENCE, guard=2e-7)


def test_a_missing_iteration_is_an_error_not_a_pass() -> None:
    with pytest.raises(AssertionError, match=r"iterations \[4\] missing"):
        relative_differences({1: 4.0, 2: 4.0, 3: 4.0}, REFERENCE)


def test_the_envelope_is_the_running_maximum_of_the_floor() -> None:
    verdict = FloorVerdict("x", {1: 0.0, 2: 0.0, 3: 0.0}, {1: 3e-6, 2: 1e-6, 3: 2e-6}, 2.0, 0.0)
    assert list(verdict.bounds.values()) == pytest.approx([6e-6, 6e-6, 6e-6])

"""The ``multirank`` marker, enforced: a test that launches ranks without it fails.

``pytest -m "not multirank"`` is the single-process selection (the oldest-stack CI run), so a test
that launches processes (``megatron_muon.testing.run_on_ranks``, directly or through the
benchmarks, or ``tests/torchrun.py``) must carry ``@pytest.mark.multirank``. tests/conftest.py
records whether the running test carries it (``set_test_is_multirank``) and installs
``require_multirank_marker`` as the launcher's check (``megatron_muon.testing.set_launch_check``).
"""

from __future__ import annotations

# Whether the running test carries the ``multirank`` marker (tests/conftest.py sets it before each
# test's fixtures); None outside pytest.
_test_is_multirank: bool | None = None


def set_test_is_multirank(value: bool | None) -> None:
    """Called by tests/conftest.py before each test's set-up."""
    global _test_is_multirank
    _test_is_multirank = value


def require_multirank_marker(what: str) -> None:
    """Raises when a test without ``@pytest.mark.multirank`` launches ranks.

    Without the marker the test would be selected by ``-m "not multirank"`` (the single-process
    run) and launch processes there.
    """
    if _test_is_multirank is False:
        raise RuntimeError(
            f"this test launches {what} but is not marked @pytest.mark.multirank "
            "(tests/multirank.py): mark it, or its fixture's tests"
        )

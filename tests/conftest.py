"""Test-wide settings: one thread per process (ranks share the 2 CPU cores; a second thread adds
nothing), and the ``multirank`` marker.

Tests that launch several processes carry ``@pytest.mark.multirank`` (registered in pyproject.toml);
``-m "not multirank"`` selects the single-process tests. A launch from an unmarked test fails
(``tests.harness.require_multirank_marker``), so the selection stays exact.
"""

import pytest
import torch

from tests import harness

torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before the test's fixtures: a module-scoped fixture that launches ranks runs in the set-up
    # of the first test that uses it.
    harness.set_test_is_multirank(item.get_closest_marker("multirank") is not None)

"""Test-wide settings: one thread per process (ranks share the 2 CPU cores; a second thread adds
nothing), the ``multirank`` marker, and the DP=1 reference run of Megatron-LM's
loop that several test modules compare with.

Tests marked ``@pytest.mark.gpu`` need a CUDA device: without one they are skipped with the reason
(CI is CPU-only); ``scripts/gpu_check.sh OUTDIR`` runs them on a GPU machine (docs/gpu.md).

Tests that launch several processes carry ``@pytest.mark.multirank`` (registered in pyproject.toml);
``-m "not multirank"`` selects the single-process tests. A launch from an unmarked test fails
(``tests.multirank.require_multirank_marker``, installed as the launcher's check), so the selection
stays exact.
"""

import pytest
import torch

from megatron_muon.testing import set_launch_check
from tests import multirank

torch.set_num_threads(1)
set_launch_check(multirank.require_multirank_marker)


GPU_SKIP_REASON = (
    "gpu: no CUDA device here (CI is CPU-only); run scripts/gpu_check.sh OUTDIR on a GPU machine "
    "(docs/gpu.md)"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before the test's fixtures: a module-scoped fixture that launches ranks runs in the set-up
    # of the first test that uses it.
    multirank.set_test_is_multirank(item.get_closest_marker("multirank") is not None)


@pytest.fixture(scope="session")
def muon_dp1():
    """Muon in Megatron-LM's loop on one rank: the global batch (4) in 4 micro-batches.

    The reference of every data-parallel layout of the same tiny GPT and flags (``MUON_FLAGS``):
    the four sharding strategies at DP=2 and HSDP at 4 ranks. One launch for the whole session.
    """
    from tests.torchrun import MUON_FLAGS, run_megatron

    return run_megatron(
        [*MUON_FLAGS, "--data-parallel-sharding-strategy", "optim_grads_params"], nproc=1
    )


@pytest.fixture(scope="session")
def muon_dp1_floor():
    """``muon_dp1`` again with every weight one ulp up: the floor of the comparisons against it
    (tests/run_comparison.py). One launch for the whole session."""
    from tests.run_comparison import floor_run
    from tests.torchrun import MUON_FLAGS

    return floor_run(
        [*MUON_FLAGS, "--data-parallel-sharding-strategy", "optim_grads_params"], nproc=1
    )

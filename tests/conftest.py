"""Test-wide settings: one thread per process (a second thread adds nothing on a shared 2-core
machine), deterministic seeds; the DP=1 reference run of Megatron-LM's loop that several test
modules compare with."""

import pytest
import torch

torch.set_num_threads(1)


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

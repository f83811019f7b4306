"""A checkpoint saved with one ``--optimizer`` and loaded with another is refused naming both.

``integrations.checkpoint_guards.optimizer_kind.state_kinds_refusal`` on the per-param optimizer
state keys each optimizer's run holds in Megatron-LM's loop under Megatron-FSDP (Muon, adaptive
Muon, Lion and Adam: the matrices' state beside AdamW's for embeddings, norms and biases). Lion's
and Adam's key names are the same; they differ per param (Lion's matrices hold ``exp_avg`` alone);
SOAP's matrices hold Kronecker factors. A ``.metadata`` that does not read is named before the
comparison. Launched: a Muon checkpoint into an Adam run through ``python -m
megatron_muon.pretrain`` (tests/test_pretrain_entry.py), a Lion checkpoint into a SOAP run in
Megatron-LM's loop with ``install()`` alone (tests/test_lion_on_megatron_fsdp.py).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import pytest

from megatron_muon.optimizers.psgd_matrix import STATE_KEYS as PSGD_KEYS
from megatron_muon.optimizers.soap_matrix import STATE_KEYS as SOAP_KEYS

_ADAM = {"exp_avg", "exp_avg_sq", "step"}
STATE = {
    "muon": [{"momentum_buffer"}, _ADAM],
    "adaptive_muon": [{"momentum_buffer", "moment2_buffer"}, _ADAM],
    "lion": [{"exp_avg"}, _ADAM],
    "soap": [set(SOAP_KEYS), _ADAM],
    "psgd_pro": [set(PSGD_KEYS), _ADAM],
    "adam": [_ADAM, _ADAM],
}


@pytest.mark.parametrize("saved, loading", list(itertools.permutations(STATE, 2)))
def test_a_checkpoint_of_another_optimizer_is_refused_naming_both(saved: str, loading: str) -> None:
    from megatron_muon.integrations.checkpoint_guards.optimizer_kind import state_kinds_refusal

    refusal = state_kinds_refusal(STATE[saved], STATE[loading], loading, "/ckpt", "/ckpt/iter_4")
    assert refusal is not None, (saved, loading)
    assert f"(saved by --optimizer {saved})" in refusal, refusal
    assert f"this run's --optimizer {loading} keeps" in refusal, refusal


@pytest.mark.parametrize("optimizer", list(STATE))
def test_a_checkpoint_of_the_same_optimizer_loads(optimizer: str) -> None:
    from megatron_muon.integrations.checkpoint_guards.optimizer_kind import (
        optimizer_of_state,
        state_kinds_refusal,
    )

    assert optimizer_of_state(STATE[optimizer]) == optimizer
    assert state_kinds_refusal(STATE[optimizer], STATE[optimizer], optimizer, "/c", "/c/i") is None


def test_a_checkpoint_whose_metadata_does_not_read_is_refused_naming_the_file(
    tmp_path: Path,
) -> None:
    from megatron_muon.checkpointing import IncompleteCheckpointError
    from megatron_muon.integrations.checkpoint_guards.optimizer_kind import (
        check_optimizer_state_kinds,
    )

    directory = tmp_path / "iter_0000004"
    directory.mkdir()
    (directory / ".metadata").write_bytes(b"\x80\x04\x95truncated")
    args = argparse.Namespace(load=str(tmp_path), ckpt_step=4, ckpt_format="fsdp_dtensor")
    args.optimizer = "muon"
    with pytest.raises(IncompleteCheckpointError, match=r"iter_0000004/\.metadata does not read"):
        check_optimizer_state_kinds(args, optimizer=object())


def _adaptive_muon_checkpoint(directory: Path, method: str, tp: int) -> None:
    """A DCP checkpoint (one process) holding what the check reads: Megatron's ``args`` and a
    matrix's adaptive_muon state keys."""
    import torch
    import torch.distributed.checkpoint as dcp

    args = argparse.Namespace(adaptive_muon_moment2_method=method, tensor_model_parallel_size=tp)
    state = {"momentum_buffer": torch.zeros(4, 4), "moment2_buffer": torch.zeros(4, 1)}
    dcp.save(
        {"args": args, "optimizer": {"state": {"w": state}}}, checkpoint_id=directory, no_dist=True
    )


@pytest.mark.parametrize("method", ["normuon", "namo"])
def test_per_partition_second_moments_at_another_tp_size_are_refused_naming_both(
    tmp_path: Path, method: str
) -> None:
    from megatron_muon.integrations.checkpoint_guards.optimizer_kind import tensor_parallel_refusal

    _adaptive_muon_checkpoint(tmp_path, method, tp=2)
    saved = STATE["adaptive_muon"]
    at_1 = argparse.Namespace(load="ckpts", tensor_model_parallel_size=1)
    refusal = tensor_parallel_refusal(at_1, str(tmp_path), saved)
    assert refusal is not None
    assert f"adaptive_muon {method} second moments of --tensor-model-parallel-size 2" in refusal
    assert "this run has --tensor-model-parallel-size 1" in refusal
    at_2 = argparse.Namespace(load="ckpts", tensor_model_parallel_size=2)
    assert tensor_parallel_refusal(at_2, str(tmp_path), saved) is None


def test_elementwise_second_moments_load_at_any_tp_size(tmp_path: Path) -> None:
    from megatron_muon.integrations.checkpoint_guards.optimizer_kind import tensor_parallel_refusal

    _adaptive_muon_checkpoint(tmp_path, "adamuon", tp=2)
    at_1 = argparse.Namespace(load="ckpts", tensor_model_parallel_size=1)
    assert tensor_parallel_refusal(at_1, str(tmp_path), STATE["adaptive_muon"]) is None

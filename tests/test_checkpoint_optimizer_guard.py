"""A checkpoint saved with one ``--optimizer`` and loaded with another is refused naming both.

``integrations.checkpoint_optimizer_kind.state_kinds_refusal`` on the per-param optimizer state
keys each optimizer's run holds in Megatron-LM's loop under Megatron-FSDP (Muon, adaptive Muon,
Lion and Adam: the matrices' state beside AdamW's for embeddings, norms and biases). Lion's and
Adam's key names are the same; they differ per param (Lion's matrices hold ``exp_avg`` alone);
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

from megatron_muon.optimizers.soap_matrix import STATE_KEYS as SOAP_KEYS

_ADAM = {"exp_avg", "exp_avg_sq", "step"}
STATE = {
    "muon": [{"momentum_buffer"}, _ADAM],
    "adaptive_muon": [{"momentum_buffer", "moment2_buffer"}, _ADAM],
    "lion": [{"exp_avg"}, _ADAM],
    "soap": [set(SOAP_KEYS), _ADAM],
    "adam": [_ADAM, _ADAM],
}


@pytest.mark.parametrize("saved, loading", list(itertools.permutations(STATE, 2)))
def test_a_checkpoint_of_another_optimizer_is_refused_naming_both(saved: str, loading: str) -> None:
    from megatron_muon.integrations.checkpoint_optimizer_kind import state_kinds_refusal

    refusal = state_kinds_refusal(STATE[saved], STATE[loading], loading, "/ckpt", "/ckpt/iter_4")
    assert refusal is not None, (saved, loading)
    assert f"(saved by --optimizer {saved})" in refusal, refusal
    assert f"this run's --optimizer {loading} keeps" in refusal, refusal


@pytest.mark.parametrize("optimizer", list(STATE))
def test_a_checkpoint_of_the_same_optimizer_loads(optimizer: str) -> None:
    from megatron_muon.integrations.checkpoint_optimizer_kind import (
        optimizer_of_state,
        state_kinds_refusal,
    )

    assert optimizer_of_state(STATE[optimizer]) == optimizer
    assert state_kinds_refusal(STATE[optimizer], STATE[optimizer], optimizer, "/c", "/c/i") is None


def test_a_checkpoint_whose_metadata_does_not_read_is_refused_naming_the_file(
    tmp_path: Path,
) -> None:
    from megatron_muon.checkpointing import IncompleteCheckpointError
    from megatron_muon.integrations.checkpoint_optimizer_kind import check_optimizer_state_kinds

    directory = tmp_path / "iter_0000004"
    directory.mkdir()
    (directory / ".metadata").write_bytes(b"\x80\x04\x95truncated")
    args = argparse.Namespace(load=str(tmp_path), ckpt_step=4, ckpt_format="fsdp_dtensor")
    args.optimizer = "muon"
    with pytest.raises(IncompleteCheckpointError, match=r"iter_0000004/\.metadata does not read"):
        check_optimizer_state_kinds(args, optimizer=object())

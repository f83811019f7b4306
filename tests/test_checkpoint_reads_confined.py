"""What a crafted checkpoint can make a load do beyond naming a global: set state through BUILD,
read files outside its directory, block on a FIFO, pick another reader (docs/reliability.md,
Security).

A small DCP checkpoint (``dcp.save`` in this process: a tensor, an ``argparse.Namespace`` stored
whole), copies of it with ``.metadata`` rewritten as an attacker would, and the package's own
readers: ``safe_unpickle.check_pickles`` and ``read_metadata`` (every door's check), DCP's load
through ``RestrictedFileSystemReader`` (the load itself), ``readers.megatron_read`` /
``check_reads`` (the reader Megatron picks from the files). The same refusal on every rank of
two, within seconds, is shown in tests/test_megatron_lm_storage_faults.py (a launch it shares).
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

from megatron_muon.checkpointing import UnsafeCheckpointError, safe_unpickle
from tests.crafted_pickles import Payload

# A refusal reads nothing but stat results and a few kB of pickle: seconds at most, even on a
# loaded 2-core machine (reading /dev/zero's referenced 1 GiB, or blocking on a FIFO, does not).
REFUSED_WITHIN_S = 10.0


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    directory = tmp_path / "saved"
    state = {"weight": torch.arange(64.0).reshape(8, 8), "args": argparse.Namespace(lr=0.02)}
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return directory


def _metadata(directory: Path) -> Any:
    with open(directory / ".metadata", "rb") as handle:
        return pickle.load(handle)  # the test's own save


def _reference(directory: Path, key: str, **changes: Any) -> Path:
    """``.metadata`` with ``key``'s storage reference changed (``relative_path``, ``offset``,
    ``length``), as an attacker rewrites it."""
    metadata = _metadata(directory)
    (info,) = [info for index, info in metadata.storage_data.items() if index.fqn == key]
    for name, value in changes.items():
        setattr(info, name, value)
    with open(directory / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    return directory


def _refusal(check: Any, *args: Any) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(UnsafeCheckpointError) as raised:
        check(*args)
    return str(raised.value), time.monotonic() - start


# --------------------------------------------------------------------------------------------------
# BUILD: state only on objects the unpickler created
# --------------------------------------------------------------------------------------------------


def _build_onto_a_class() -> bytes:
    """GLOBAL argparse.Namespace; BUILD (None, {"ckpt_trust_pickles": True}): plain ``pickle``
    sets the attribute on the class itself."""
    name = b"ckpt_trust_pickles"
    slot_state = pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + bytes([len(name)]) + name
    return (
        pickle.PROTO + b"\x04" + pickle.GLOBAL + b"argparse\nNamespace\n"
        + pickle.NONE + slot_state + pickle.NEWTRUE + pickle.SETITEM + pickle.TUPLE2
        + pickle.BUILD + pickle.STOP
    )  # fmt: skip


def _build_onto_an_enum_member() -> bytes:
    """REDUCE of an allowlisted enum (its shared member), then BUILD onto the member."""
    name = b"_value_"
    state = pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + bytes([len(name)]) + name
    return (
        pickle.PROTO + b"\x04"
        + pickle.GLOBAL + b"torch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
        + pickle.BININT1 + b"\x01" + pickle.TUPLE1 + pickle.REDUCE
        + state + pickle.BININT1 + b"\x07" + pickle.SETITEM + pickle.BUILD + pickle.STOP
    )  # fmt: skip


def test_a_build_onto_an_allowlisted_class_is_refused_and_the_class_is_unchanged(
    saved: Path,
) -> None:
    assert not hasattr(argparse.Namespace, "ckpt_trust_pickles")
    (saved / ".metadata").write_bytes(_build_onto_a_class())
    message, _ = _refusal(safe_unpickle.read_metadata, str(saved))
    assert f"{saved / '.metadata'}: refused to unpickle a BUILD setting state on the class " in (
        message
    )
    assert "argparse.Namespace" in message and "--ckpt-trust-pickles" in message
    assert not hasattr(argparse.Namespace, "ckpt_trust_pickles")
    # The test can fail: the same bytes through plain pickle do change the class.
    try:
        pickle.loads(_build_onto_a_class())
        assert argparse.Namespace.ckpt_trust_pickles is True  # type: ignore[attr-defined]
    finally:
        del argparse.Namespace.ckpt_trust_pickles  # type: ignore[attr-defined]


def test_a_build_onto_an_enum_member_is_refused_and_the_member_is_unchanged(saved: Path) -> None:
    member = dcp_metadata._MEM_FORMAT_ENCODING(1)
    (saved / ".metadata").write_bytes(_build_onto_an_enum_member())
    message, _ = _refusal(safe_unpickle.read_metadata, str(saved))
    assert "refused to unpickle a BUILD setting state on an object of " in message
    assert "_MEM_FORMAT_ENCODING" in message
    assert member.value == 1


class _EnumWithState:
    """Pickles as an allowlisted enum's member with a state to BUILD onto it (torch.save path)."""

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (dcp_metadata._MEM_FORMAT_ENCODING, (1,), {"_value_": 7})


def test_a_stored_value_building_onto_an_enum_member_is_refused_and_the_member_is_unchanged() -> (
    None
):
    import io

    blob = io.BytesIO()
    torch.save(_EnumWithState(), blob)
    message, _ = _refusal(safe_unpickle.load_pickled, blob.getvalue(), "item x")
    assert message.startswith("item x: refused by torch's weights_only unpickler")
    assert dcp_metadata._MEM_FORMAT_ENCODING(1).value == 1


# --------------------------------------------------------------------------------------------------
# storage references: relative, inside the directory, regular files, within their size
# --------------------------------------------------------------------------------------------------


def _cases(saved: Path) -> dict[str, tuple[Path, str, str]]:
    """case -> (crafted copy, file named in the refusal, reason)."""
    outside = saved.parent / "outside.bin"
    outside.write_bytes(b"x" * 4096)
    cases = {}
    for case, changes, named, reason in (
        ("parent", {"relative_path": "../outside.bin"}, "../outside.bin", "leaving the checkpoint"),
        ("absolute", {"relative_path": "/etc/passwd"}, "/etc/passwd", "an absolute path"),
        (
            "dev_zero",
            {"relative_path": "/dev/zero", "offset": 0, "length": 1 << 30},
            "/dev/zero",
            "an absolute path",
        ),
        ("fifo", {"relative_path": "fifo"}, "fifo", "not a regular file (a FIFO)"),
        ("symlink", {"relative_path": "link"}, "link", "outside the directory"),
    ):
        copy = saved.parent / case
        shutil.copytree(saved, copy)
        cases[case] = (_reference(copy, "args", **changes), named, reason)
    os.mkfifo(cases["fifo"][0] / "fifo")
    os.symlink(outside, cases["symlink"][0] / "link")
    return cases


def test_storage_references_outside_the_directory_or_not_regular_files_are_refused(
    saved: Path,
) -> None:
    for case, (copy, named, reason) in _cases(saved).items():
        for check in (safe_unpickle.check_pickles, safe_unpickle.read_metadata):
            message, elapsed = _refusal(check, str(copy))
            assert message.startswith(f"{os.path.join(copy, named)}: refused ("), (case, message)
            assert reason in message, (case, message)
            assert elapsed < REFUSED_WITHIN_S, (case, elapsed)


def test_a_reference_past_a_files_end_is_refused_as_truncated(saved: Path) -> None:
    from megatron_muon.checkpointing import IncompleteCheckpointError

    size = os.path.getsize(saved / "__0_0.distcp")
    _reference(saved, "args", offset=size, length=1 << 30)
    with pytest.raises(IncompleteCheckpointError) as raised:
        safe_unpickle.check_pickles(str(saved))
    assert str(raised.value) == (
        f"checkpoint {saved} is damaged: __0_0.distcp holds {size} bytes, its .metadata "
        f"references {size + (1 << 30)} (truncated)"
    )


def test_dcps_own_load_through_the_restricted_reader_refuses_a_fifo_before_opening_it(
    saved: Path,
) -> None:
    copy = _cases(saved)["fifo"][0]
    state = {"weight": torch.zeros(8, 8), "args": None}
    start = time.monotonic()
    # DCP wraps its reader's error (CheckpointException, a BaseException), our message inside;
    # torch 2.9 to 2.11's DCP swallows a reader's error on the global .metadata to try per-rank
    # files and then stops with "metadata is None" (refused all the same, our message lost there;
    # Megatron's doors check first and name the file: test_megatron_lm_storage_faults).
    refused = "fifo: refused \\(not a regular file \\(a FIFO\\)\\)|metadata is None"
    with pytest.raises(BaseException, match=refused):
        dcp.load(state, storage_reader=safe_unpickle.RestrictedFileSystemReader(copy), no_dist=True)
    assert time.monotonic() - start < REFUSED_WITHIN_S
    assert torch.equal(state["weight"], torch.zeros(8, 8))


# --------------------------------------------------------------------------------------------------
# the reader Megatron picks, and the directory it reads
# --------------------------------------------------------------------------------------------------


def _tracked(root: Path, saved: Path, iteration: int) -> Path:
    """``root`` as a ``--load`` directory: ``saved`` as its ``iter_XXXXXXX``, the tracker naming
    it."""
    shutil.copytree(saved, root / f"iter_{iteration:07d}")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def test_the_reader_is_chosen_by_the_files_and_each_is_checked_or_refused_by_name(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron_muon.integrations.checkpoint_guards.readers import check_reads, megatron_read

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # torch.load's default: unsafe
    marker = tmp_path / "common.ran"
    dist = _tracked(tmp_path / "torch_dist", saved, 4)
    directory = dist / "iter_0000004"
    (directory / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    torch.save(Payload(str(marker)), directory / "common.pt")
    legacy = _tracked(tmp_path / "legacy", saved, 4)
    (legacy / "iter_0000004" / "mp_rank_00").mkdir()
    args = {"ckpt_step": None, "use_megatron_fsdp": True, "non_persistent_ckpt_type": None}
    dcp_read = megatron_read(
        SimpleNamespace(load=str(_tracked(tmp_path / "dcp", saved, 4)), **args)
    )
    assert dcp_read.format == "fsdp_dtensor"
    check_reads(dcp_read)
    read = megatron_read(SimpleNamespace(load=str(dist), **args))
    assert read == (str(directory), "torch_dist")
    message, _ = _refusal(check_reads, read)
    assert f"{directory / 'common.pt'}: refused to unpickle the global posix.system" in message
    read = megatron_read(SimpleNamespace(load=str(legacy), **args))
    assert read.format == "torch"
    message, _ = _refusal(check_reads, read)
    assert f"{legacy / 'iter_0000004'}: Megatron would read it as a 'torch' checkpoint" in message
    assert not marker.exists()


def test_ckpt_step_0_and_a_pretrained_checkpoint_resolve_to_the_directory_megatron_reads(
    saved: Path, tmp_path: Path
) -> None:
    from megatron.training.checkpointing import get_load_checkpoint_path_by_args

    from megatron_muon.integrations.checkpoint_guards.load_directory import checkpoint_directory
    from megatron_muon.integrations.checkpoint_guards.readers import megatron_read

    load = _tracked(tmp_path / "load", saved, 4)
    args = SimpleNamespace(load=str(load), ckpt_step=0, non_persistent_ckpt_type=None)
    megatron = get_load_checkpoint_path_by_args(args)  # Megatron's own resolution
    assert megatron == str(load / "iter_0000004")
    assert checkpoint_directory(args) == megatron
    assert megatron_read(args).directory == megatron
    # --pretrained-checkpoint without --load (the RL reference load sets args.load = None).
    args = SimpleNamespace(load=None, pretrained_checkpoint=str(load), ckpt_step=None)
    args.non_persistent_ckpt_type = None
    assert megatron_read(args) == (str(load / "iter_0000004"), "torch_dcp")


def test_non_persistent_checkpoints_are_read_as_megatron_prefers_them(
    saved: Path, tmp_path: Path
) -> None:
    from megatron_muon.integrations.checkpoint_guards.readers import check_reads, megatron_read

    load = _tracked(tmp_path / "load", saved, 4)
    _tracked(load / "non_persistent", saved, 6)  # newer: Megatron loads it, as torch_dist
    args = SimpleNamespace(load=str(load), ckpt_step=None, non_persistent_ckpt_type="global")
    args.non_persistent_global_ckpt_dir = None
    assert megatron_read(args) == (str(load / "non_persistent" / "iter_0000006"), "torch_dist")
    args.ckpt_step = 8  # a persistent step past it: Megatron loads iter_0000008 instead
    assert megatron_read(args) is None  # no such directory: Megatron raises, reading nothing
    args.non_persistent_ckpt_type, args.ckpt_step = "local", None
    message, _ = _refusal(check_reads, megatron_read(args))
    assert "Megatron would read it as a 'non-persistent local' checkpoint" in message

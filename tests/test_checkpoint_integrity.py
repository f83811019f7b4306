"""Checkpoints are whole or refused, and a refusal keeps every rank's collectives in step.

- A save that cannot be whole (ranks passing different paths, a rank that cannot see the directory
  rank 0 created, ranks holding different params, an ``extra`` or scheduler state that cannot be
  pickled) raises the same error on every rank before anything is written, and the next
  collective still pairs up. Before these checks, different paths published rank 0's half of a
  checkpoint and an unpicklable ``extra`` left rank 1 waiting in DCP's collectives.
- A load verifies every file DCP's metadata references (listed in the marker, present, same size,
  same SHA-256) and the marker itself before it touches any state: a file the marker does not
  list, flipped bits, a marker without its file list, and an overwrite interrupted between its two
  renames are each named; nothing is changed. A checkpoint of format version 1 (saved before the
  hashes were recorded: its marker lists sizes only) resumes bitwise with every check but the
  hashes (rank 0 prints that they were not verified); a file it lacks, or one DCP's metadata
  references that its marker does not list, is refused.
- ``ShardedMuon`` given different params on different ranks names the param instead of aborting
  gloo ("Received data size doesn't match").
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from megatron_muon.testing import run_on_ranks
from tests.checkpoint_toys import (
    assert_bitwise_equal,
    assert_loads_fail,
    build,
    load_train,
    train,
    train_save_train,
)

pytestmark = pytest.mark.multirank  # every test here launches ranks


class _UnpicklableScheduler:
    def state_dict(self) -> dict:
        return {"lr_lambda": lambda step: 1.0}

    def load_state_dict(self, state: dict) -> None:  # pragma: no cover - never loaded
        pass


def _in_step(rank: int) -> float:
    """A collective after a refusal: the sum of rank + 1 over 2 ranks is 3.0 if still paired."""
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe)
    return float(probe)


def _save_refusals(rank: int, world_size: int, root: str) -> dict:
    from megatron_muon.checkpointing import files as checkpoint_files
    from megatron_muon.checkpointing import save_checkpoint

    wrapped, optimizers, scheduler = build(world_size, "optim")
    train(wrapped, optimizers, scheduler, rank, world_size, 1, 0, noise=False)
    different = torch.nn.Linear(4, 4) if rank == 0 else torch.nn.Sequential(torch.nn.Linear(4, 4))
    cases = {
        "different_paths": lambda: save_checkpoint(
            f"{root}/ck_rank{rank}", wrapped, optimizers, scheduler, iteration=1
        ),
        "unpicklable_extra": lambda: save_checkpoint(
            f"{root}/extra", wrapped, optimizers, scheduler, iteration=1, extra=lambda: None
        ),
        "unpicklable_scheduler": lambda: save_checkpoint(
            f"{root}/scheduler", wrapped, optimizers, _UnpicklableScheduler(), iteration=1
        ),
        "different_params": lambda: save_checkpoint(
            f"{root}/params",
            different,
            torch.optim.AdamW(different.parameters()),
            iteration=1,
        ),
        "directory_not_shared": lambda: save_checkpoint(
            f"{root}/not_shared", wrapped, optimizers, scheduler, iteration=1
        ),
    }
    results = {}
    for name, save in cases.items():
        if name == "directory_not_shared" and rank == 1:
            # As if rank 1's "same" path were on a node-local disk: it finds no token of rank 0.
            checkpoint_files._TOKEN_PREFIX = ".token_on_another_disk_"
        try:
            save()
            results[name] = None
        except Exception as error:  # noqa: BLE001 - the test compares what every rank raised
            results[name] = (type(error).__name__, str(error))
        results[f"{name}_collective"] = _in_step(rank)
    return results


@pytest.fixture(scope="module")
def save_refusals(tmp_path_factory) -> tuple[list[dict], str]:
    root = str(tmp_path_factory.mktemp("refusals"))
    return run_on_ranks(_save_refusals, 2, root, timeout=120), root


@pytest.mark.parametrize(
    "case,kind,phrase",
    [
        ("different_paths", "CheckpointError", "ranks passed different checkpoint paths"),
        ("unpicklable_extra", "AttributeError", "lambda"),
        ("unpicklable_scheduler", "AttributeError", "lambda"),
        ("different_params", "CheckpointError", "param 0 is weight on rank 0 and 0.weight"),
        ("directory_not_shared", "CheckpointError", "is not visible on rank 1"),
    ],
)
def test_a_save_that_cannot_be_whole_is_refused_on_every_rank_before_writing(
    save_refusals, case, kind, phrase
):
    results, root = save_refusals
    for rank, result in enumerate(results):
        assert result[case] is not None, f"rank {rank}: the save of {case} did not raise"
        assert result[case][0] == kind, (rank, result[case])
        assert phrase in result[case][1], (rank, result[case])
        assert result[f"{case}_collective"] == 3.0, f"rank {rank}: collectives out of step"
    # Nothing published (directory_not_shared leaves rank 0's .incomplete, which never loads).
    published = [name for name in os.listdir(root) if not name.endswith(".incomplete")]
    assert published == [], published


# --------------------------------------------------------------------------------------------------
# loads: every referenced file verified first
# --------------------------------------------------------------------------------------------------


def _flip_one_byte(file: str) -> None:
    with open(file, "r+b") as handle:
        handle.seek(os.path.getsize(file) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x10]))


def _edit_marker(directory: str, edit) -> None:
    from megatron_muon.checkpointing import MARKER_NAME

    marker = os.path.join(directory, MARKER_NAME)
    with open(marker) as handle:
        manifest = json.load(handle)
    edit(manifest)
    with open(marker, "w") as handle:
        json.dump(manifest, handle)


def test_a_load_verifies_every_referenced_file_before_touching_state(tmp_path):
    saved = str(tmp_path / "saved")
    run_on_ranks(train_save_train, 2, "optim", saved, 1, 0)
    copies = {}
    for case in ("unlisted", "bit_rot", "no_file_list", "overwrite"):
        copies[case] = str(tmp_path / case)
        shutil.copytree(saved, copies[case])
    # What a save whose rank 1 wrote elsewhere published: a marker listing rank 0's files only.
    os.remove(os.path.join(copies["unlisted"], "__1_0.distcp"))
    _edit_marker(copies["unlisted"], lambda m: m["files"].pop("__1_0.distcp"))
    _flip_one_byte(os.path.join(copies["bit_rot"], "__0_0.distcp"))
    _edit_marker(copies["no_file_list"], lambda m: m.pop("files"))
    # An overwrite killed between its renames: the old one set aside, the new one complete.
    os.rename(copies["overwrite"], copies["overwrite"] + ".replaced")
    shutil.copytree(saved, copies["overwrite"] + ".incomplete")
    assert_loads_fail(
        [
            (
                copies["unlisted"],
                "IncompleteCheckpointError",
                ("DCP's metadata references ['__1_0.distcp'], which its marker does not list",),
            ),
            (
                copies["bit_rot"],
                "IncompleteCheckpointError",
                ("__0_0.distcp does not have the SHA-256 it was saved with",),
            ),
            (copies["no_file_list"], "IncompleteCheckpointError", ("lacks ['files']",)),
            (
                copies["overwrite"],
                "CheckpointNotFoundError",
                (
                    ".replaced exists: the checkpoint an overwrite set aside, with a completion",
                    ".incomplete exists: a save that did not finish, with a completion marker",
                    "an overwrite stopped between its two renames",
                ),
            ),
        ]
    )


def _as_format_version_1(directory: str) -> None:
    """The marker a version 1 save wrote: each file's size, no hash."""

    def edit(manifest: dict) -> None:
        manifest["version"] = 1
        manifest["files"] = {name: entry["size"] for name, entry in manifest["files"].items()}

    _edit_marker(directory, edit)


def _load_and_train_capturing_stdout(rank: int, world_size: int, path: str, n: int) -> dict:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = load_train(rank, world_size, "optim", path, n)
    return {**result, "printed": printed.getvalue()}


def test_a_format_version_1_checkpoint_loads_with_sizes_checked_and_hashes_not(tmp_path):
    saved = str(tmp_path / "saved")
    uninterrupted = run_on_ranks(train_save_train, 2, "optim", saved, 1, 1)
    copies = {}
    for case in ("v1", "v1_missing", "v1_unlisted", "v3"):
        copies[case] = str(tmp_path / case)
        shutil.copytree(saved, copies[case])
        _as_format_version_1(copies[case])
    os.remove(os.path.join(copies["v1_missing"], "__1_0.distcp"))
    # A version 1 save whose rank 1 wrote elsewhere: rank 0's listing lacks rank 1's file.
    os.remove(os.path.join(copies["v1_unlisted"], "__1_0.distcp"))
    _edit_marker(copies["v1_unlisted"], lambda m: m["files"].pop("__1_0.distcp"))
    _edit_marker(copies["v3"], lambda m: m.update(version=3))

    resumed = run_on_ranks(_load_and_train_capturing_stdout, 2, copies["v1"], 1)
    note = "is format version 1 (saved before SHA-256 hashes were recorded)"
    assert resumed[0]["printed"].count(note) == 1, resumed[0]["printed"]
    assert "hashes were not verified" in resumed[0]["printed"]
    assert note not in resumed[1]["printed"], resumed[1]["printed"]
    for rank in range(2):
        assert resumed[rank]["iteration"] == 1
        assert_bitwise_equal(
            uninterrupted[rank]["snapshot"], resumed[rank]["snapshot"], f"rank {rank}"
        )
    assert_loads_fail(
        [
            (
                copies["v1_missing"],
                "IncompleteCheckpointError",
                ("__1_0.distcp (rank 1's shards) is missing",),
            ),
            (
                copies["v1_unlisted"],
                "IncompleteCheckpointError",
                ("DCP's metadata references ['__1_0.distcp'], which its marker does not list",),
            ),
            (
                copies["v3"],
                "CheckpointMismatchError",
                ("version 3; this reader expects megatron_muon.fsdp_dtensor version 2 (or 1)",),
            ),
        ]
    )


# --------------------------------------------------------------------------------------------------
# ShardedMuon: different params on different ranks
# --------------------------------------------------------------------------------------------------


def _muon_with_different_params(rank: int, world_size: int) -> dict:
    from megatron_muon import ShardedMuon

    results = {}
    shapes = {
        "count": [(8, 4)] if rank == 0 else [(8, 4), (6, 4)],
        "shape": [(8, 4)] if rank == 0 else [(6, 4)],
    }
    for case, param_shapes in shapes.items():
        params = [torch.nn.Parameter(torch.randn(*shape)) for shape in param_shapes]
        for param in params:
            param.grad = torch.randn_like(param)
        try:
            ShardedMuon.from_keywords(params, lr=0.01).step()
            results[case] = None
        except ValueError as error:
            results[case] = str(error)
        results[f"{case}_collective"] = _in_step(rank)
    return results


def test_sharded_muon_names_the_param_when_ranks_hold_different_params():
    for rank, result in enumerate(run_on_ranks(_muon_with_different_params, 2, timeout=60)):
        assert "ranks hold different numbers of params: [1, 2]" in result["count"], (rank, result)
        assert "param 0 has global shape (8, 4)" in result["shape"], (rank, result)
        assert "(6, 4) on another" in result["shape"], (rank, result)
        assert result["count_collective"] == result["shape_collective"] == 3.0

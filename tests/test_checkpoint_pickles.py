"""A ``megatron_muon.checkpointing`` checkpoint from elsewhere runs no code when loaded.

One save (2 ranks), copies crafted as an attacker who can write the directory would craft them
(``tests/crafted_pickles.py``: each marker's file listing rewritten to match), one launch loading
them all: ``.metadata``, a small object we pickle (``extra``, inside DCP's stored bytes) and a
value DCP stores whole (the scheduler's bytes) replaced by a pickle that runs ``touch``; every
load is refused on every rank naming the file and the global, nothing changed, and no marker
exists afterwards. The same kind of copies holding a harmless type outside the allowlist (a
user's ``TrainerNote`` in ``extra``, or in ``.metadata``'s ``planner_data``) are refused without
the opt-in and load with ``trust_pickles=True``, resuming bitwise: the allowlist, nothing else,
refused them.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.checkpoint_toys import (
    assert_bitwise_equal,
    build,
    local_snapshot,
    train,
    train_save_train,
)
from tests.crafted_pickles import (
    Payload,
    TrainerNote,
    note_in_metadata,
    replace_item,
    replace_metadata,
)

pytestmark = pytest.mark.multirank  # every test here launches ranks

MARKER = "megatron_muon_checkpoint.json"
NOTE = TrainerNote("resume from shard 3")


def _loads(rank: int, world_size: int, refused: list[str], trusted: list[str]) -> dict:
    """Tries each of ``refused`` (reporting the error and whether state stayed untouched), then
    loads each of ``trusted`` with ``trust_pickles=True`` and trains one step from the last (a
    resume)."""
    from megatron_muon.checkpointing import CheckpointError, load_checkpoint

    wrapped, optimizers, scheduler = build(world_size, "optim", seed=123)
    before = local_snapshot(wrapped, optimizers)
    results = []
    for path in refused:
        try:
            load_checkpoint(path, wrapped, optimizers, scheduler)
            results.append({"type": None, "message": ""})
        except CheckpointError as error:
            results.append({"type": type(error).__name__, "message": str(error)})
        after = local_snapshot(wrapped, optimizers)
        results[-1]["unchanged"] = all(
            torch.equal(tensor, after["params"][name]) for name, tensor in before["params"].items()
        )
    extras = []
    for path in trusted:
        loaded = load_checkpoint(path, wrapped, optimizers, scheduler, trust_pickles=True)
        extras.append(loaded.extra)
    train(wrapped, optimizers, scheduler, rank, world_size, 1, loaded.iteration, noise=True)
    return {"refused": results, "extras": extras, "resumed": local_snapshot(wrapped, optimizers)}


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("pickles")
    saved = str(root / "saved")
    uninterrupted = run_on_ranks(train_save_train, 2, "optim", saved, 1, 1)
    copies, markers = {}, {}
    for case in ("metadata", "extra", "scheduler", "note_extra", "note_metadata"):
        copies[case] = str(root / case)
        markers[case] = str(root / f"{case}.ran")
        shutil.copytree(saved, copies[case])
    replace_metadata(copies["metadata"], MARKER, Payload(markers["metadata"]))
    files = {
        "extra": replace_item(
            copies["extra"], MARKER, "common.extra", Payload(markers["extra"]), nested=True
        ),
        "scheduler": replace_item(
            copies["scheduler"], MARKER, "common.scheduler", Payload(markers["scheduler"]), False
        ),
    }
    replace_item(copies["note_extra"], MARKER, "common.extra", {"note": NOTE}, nested=True)
    note_in_metadata(copies["note_metadata"], MARKER, NOTE)
    refused = [copies[c] for c in ("metadata", "extra", "scheduler", "note_extra", "note_metadata")]
    trusted = [copies["note_metadata"], copies["note_extra"]]
    loads = run_on_ranks(_loads, 2, refused, trusted)
    return {
        "copies": copies,
        "markers": markers,
        "files": files,
        "uninterrupted": uninterrupted,
        "loads": loads,
    }


def test_a_pickle_naming_another_global_is_refused_on_every_rank_and_never_runs(crafted):
    copies, files = crafted["copies"], crafted["files"]
    expected = {
        "metadata": (os.path.join(copies["metadata"], ".metadata"), "posix.system"),
        "extra": (
            os.path.join(copies["extra"], files["extra"]) + " (item common.extra)",
            "posix.system",
        ),
        "scheduler": (
            os.path.join(copies["scheduler"], files["scheduler"]) + " (item common.scheduler)",
            "posix.system",
        ),
        "note_extra": ("(item common.extra)", "tests.crafted_pickles.TrainerNote"),
        "note_metadata": (".metadata", "tests.crafted_pickles.TrainerNote"),
    }
    for rank, result in enumerate(crafted["loads"]):
        for (case, (where, name)), refusal in zip(expected.items(), result["refused"], strict=True):
            assert refusal["type"] == "UnsafeCheckpointError", (rank, case, refusal)
            assert where in refusal["message"], (rank, case, refusal["message"])
            assert f"refused to unpickle the global {name}" in refusal["message"], refusal
            assert "trust_pickles=True" in refusal["message"]
            assert refusal["unchanged"], (rank, case)
    for case, marker in crafted["markers"].items():
        assert not os.path.exists(marker), f"the payload of {case} ran"


def test_with_trust_pickles_a_checkpoint_holding_other_types_loads_and_resumes_bitwise(crafted):
    for result in crafted["loads"]:
        assert result["extras"] == [{"tokens": 7}, {"note": NOTE}]
    for rank, result in enumerate(crafted["loads"]):
        assert_bitwise_equal(
            crafted["uninterrupted"][rank]["snapshot"], result["resumed"], f"rank {rank}"
        )

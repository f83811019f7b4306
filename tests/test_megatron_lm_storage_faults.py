"""Storage faults in Megatron-LM's loop with Muon on Megatron-FSDP: nothing half-saved, nothing
half-loaded, no rank left waiting (``megatron_muon.integrations.checkpoint_guards.integrity``).

Three launches of ``examples/pretrain_gpt_megatron.py`` (``tests/torchrun.py``: 2 CPU ranks,
optim_grads_params, ``fsdp_dtensor``, ``--save-interval 4``), in order:

1. the disk fills up on rank 1 during the save of iteration 8 (``RLIMIT_FSIZE`` from that save
   on: ``tests/megatron_lm_driver.py``): both ranks stop with the one error naming the directory
   and the cause, the tracker still names iteration 4, no ``iter_0000008`` is left;
2. a run with ``--load`` of that directory resumes from iteration 4 and repeats iterations 5 to 8
   exactly (the same grad norms at full precision, the same losses as printed);
3. ``--load`` of a copy of iteration 4 with one bit flipped in a data file: every rank refuses it,
   naming the file, before training (stock Megatron loaded it silently);
4. ``--load`` of a copy whose ``.metadata`` is a pickle that runs ``touch`` (and whose ``args`` is
   one too), ``megatron_muon_files.json`` rewritten to match as an attacker would
   (``tests/crafted_pickles.py``): every rank refuses it naming the file and the global, and the
   command never ran (stock: it ran); ``integrations.checkpoint_guards.pickles``;
5. ``--load --ckpt-trust-pickles`` of a copy whose ``args`` holds a user's type outside the
   allowlist (refused without the flag, below) resumes: iterations 5 to 8 repeat bitwise;
6. the other doors a checkpoint comes in through (``integrations.checkpoint_guards.readers``),
   one crafted copy each, every payload a ``touch``, every listing rewritten: ``--pretrained-
   checkpoint`` without ``--load`` (the RL reference load's way), ``--use-checkpoint-args``
   (before ``torch.distributed`` starts), and two format switches run with
   ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``: ``metadata.json`` + ``common.pt`` beside ``.metadata``
   (Megatron's ``torch_dist`` reader; with ``--ckpt-step 0``, which Megatron reads as "not given")
   and an ``mp_rank_00/`` folder (its legacy reader, whose failure path exits 0): every launch
   fails on every rank with ``UnsafeCheckpointError`` naming the file and the global or the
   format, before training, and no payload ran;
7. the same doors with ``--ckpt-trust-pickles``, one launch: ``--use-checkpoint-args`` and
   ``--pretrained-checkpoint`` (``--load`` empty) of the copy whose ``args`` holds a user's type:
   it loads and trains;
8. ``--load`` of a copy whose ``.metadata`` lacks one model tensor (every pickle allowlisted, the
   listing rewritten): DCP still refuses it on every rank, "Missing key in checkpoint
   state_dict".

The other refusals of a load (a truncated data file in a checkpoint saved without the hashes, a
truncated ``.metadata``, an empty tracker, a save that never finished, a ``.metadata`` whose
stored item is read from a FIFO) call the same check that ``--load`` runs, on the files launch 1
wrote, from ``run_on_ranks``: a torchrun launch each would cost 15 to 45 s. ``--async-save`` is
refused at argument validation (single process).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_muon.testing import run_on_ranks
from tests.crafted_pickles import (
    Payload,
    TrainerNote,
    drop_entry,
    reads_as_legacy,
    reads_as_torch_dist,
    reference_fifo,
    replace_item,
    replace_metadata,
)
from tests.torchrun import MegatronRun, run_megatron

pytestmark = pytest.mark.timeout(600)

SAVE_INTERVAL = 4
FULL_AT = 8  # the save that fills the disk
TRAIN_ITERS = 12
FLAGS = [
    *("--optimizer muon --lr 0.02 --muon-fp32-matmul-prec high").split(),
    *("--data-parallel-sharding-strategy optim_grads_params").split(),
    *("--train-iters", str(TRAIN_ITERS), "--save-interval", str(SAVE_INTERVAL)),
]
# Rank 1 may write no file beyond 20 kB from the save of iteration 8 on; its shard file of the
# tiny GPT's checkpoint holds 1.2 MB.
DISK_FULL = {"MEGATRON_MUON_FILE_SIZE_LIMIT": f"1:{FULL_AT}:20000"}
TRACKER = "latest_checkpointed_iteration.txt"
SAVED = f"iter_{SAVE_INTERVAL:07d}"


def _flip_one_byte(file: Path) -> None:
    with open(file, "r+b") as handle:
        handle.seek(os.path.getsize(file) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x10]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The three launches of the module docstring, and the damaged copies made between them."""
    root = tmp_path_factory.mktemp("storage_faults")
    save = root / "checkpoints"
    full = run_megatron([*FLAGS, "--save", str(save)], env=DISK_FULL, check=False)
    listing = sorted(os.listdir(save))
    tracker = (save / TRACKER).read_text()
    copies = {}
    for case in (
        "bit_flip",
        "truncated",
        "metadata",
        "empty_tracker",
        "unfinished",
        "fifo",
        "missing_key",
        *_PICKLE_CASES,
        *_FORMAT_CASES,
    ):
        copies[case] = root / case
        shutil.copytree(save / SAVED, copies[case] / SAVED)
        (copies[case] / TRACKER).write_text(str(SAVE_INTERVAL))
    markers = _craft_pickles(copies, root)
    resumed = run_megatron([*FLAGS, "--load", str(save), "--save", str(save), "--no-load-rng"])
    _flip_one_byte(copies["bit_flip"] / SAVED / "__0_0.distcp")
    refused = run_megatron(
        [*FLAGS, "--load", str(copies["bit_flip"]), "--no-load-rng"], check=False
    )
    unsafe = run_megatron([*FLAGS, "--load", str(copies["payload"]), "--no-load-rng"], check=False)
    trusted = run_megatron(
        [*FLAGS, "--load", str(copies["note"]), "--no-load-rng", "--ckpt-trust-pickles"]
    )
    doors = _through_the_other_doors(copies, root)
    return {
        "doors": doors,
        "full": full,
        "listing": listing,
        "tracker": tracker,
        "save": save,
        "resumed": resumed,
        "refused": refused,
        "copies": copies,
        "unsafe": unsafe,
        "trusted": trusted,
        "markers": markers,
    }


_PICKLE_CASES = ("payload", "payload_args", "note")
_FORMAT_CASES = ("torch_dist", "legacy")
MISSING = "model.module.decoder.layers.0.mlp.linear_fc2.weight"
NOTE = TrainerNote("from the colleague's run")
LISTING = "megatron_muon_files.json"


def _craft_pickles(copies: dict[str, Path], root: Path) -> dict[str, str]:
    """4. to 6. of the module docstring; returns the payloads' marker files."""
    import torch

    markers = {case: str(root / f"{case}.ran") for case in (*_PICKLE_CASES[:2], *_FORMAT_CASES)}
    reads_as_torch_dist(str(copies["torch_dist"] / SAVED), LISTING, Payload(markers["torch_dist"]))
    reads_as_legacy(str(copies["legacy"] / SAVED), LISTING, Payload(markers["legacy"]))
    reference_fifo(str(copies["fifo"] / SAVED), LISTING, "args")
    drop_entry(str(copies["missing_key"] / SAVED), LISTING, MISSING)
    listing = "megatron_muon_files.json"
    replace_item(
        str(copies["payload"] / SAVED), listing, "args", Payload(markers["payload"]), False
    )
    replace_metadata(str(copies["payload"] / SAVED), listing, Payload(markers["payload"]))
    directory = str(copies["payload_args"] / SAVED)
    replace_item(directory, listing, "args", Payload(markers["payload_args"]), False)
    args = _saved_args(copies["note"] / SAVED, torch)
    args.note = NOTE
    replace_item(str(copies["note"] / SAVED), listing, "args", args, False)
    return markers


# torch.load's default turned to weights_only=False in the ranks (set by the driver: no launch
# zygote of its own, tests/megatron_lm_driver.py).
_NO_WEIGHTS_ONLY = ["--megatron-muon-setenv", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1"]


def _through_the_other_doors(copies: dict[str, Path], root: Path) -> dict[str, Any]:
    """6. and 7. of the module docstring: one launch per door, one with the opt-in."""
    doors: dict[str, list[str]] = {
        "pretrained": ["--pretrained-checkpoint", str(copies["payload"])],
        "checkpoint_args": ["--load", str(copies["payload_args"]), "--use-checkpoint-args"],
        "torch_dist": [*_NO_WEIGHTS_ONLY, "--load", str(copies["torch_dist"]), "--ckpt-step", "0"],
        "legacy": [*_NO_WEIGHTS_ONLY, "--load", str(copies["legacy"])],
        "missing_key": ["--load", str(copies["missing_key"])],
    }
    runs = {
        door: run_megatron([*FLAGS, *flags, "--no-load-rng"], check=False)
        for door, flags in doors.items()
    }
    (root / "empty").mkdir()
    trusted = [
        *("--load", str(root / "empty"), "--pretrained-checkpoint", str(copies["note"])),
        *("--use-checkpoint-args", "--ckpt-trust-pickles", "--train-iters", "2"),
    ]
    runs["trusted"] = run_megatron([*FLAGS, *trusted])
    return runs


def _saved_args(directory: Path, torch: Any) -> argparse.Namespace:
    import pickle

    with open(directory / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # the test's own save
    ((index, info),) = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == "args"]
    with open(directory / info.relative_path, "rb") as handle:
        handle.seek(info.offset)
        import io

        return torch.load(io.BytesIO(handle.read(info.length)), weights_only=False)


@pytest.mark.multirank
def test_a_save_on_a_full_disk_stops_every_rank_with_one_error_and_publishes_nothing(
    runs: dict[str, Any],
) -> None:
    full: MegatronRun = runs["full"]
    assert full.returncode != 0
    assert sorted(full.iterations) == list(range(1, FULL_AT + 1))
    directory = runs["save"] / f"iter_{FULL_AT:07d}"
    error = (
        f"CheckpointError: saving the checkpoint of iteration {FULL_AT} to {directory} failed: "
        f"rank 1: EFBIG File too large. Nothing was published: {runs['save'] / TRACKER} still "
        f"names iteration {SAVE_INTERVAL}, which this save did not touch; the partial "
        f"{directory} was removed"
    )
    for rank, output in full.rank_outputs.items():
        assert error in output, f"rank {rank}:\n{output[-3000:]}"
        # One error: not DCP's CheckpointException with a traceback per failing rank.
        assert "(RANK 1)" not in output, f"rank {rank}:\n{output[-3000:]}"
    assert runs["tracker"].strip() == str(SAVE_INTERVAL)
    assert runs["listing"] == [SAVED, TRACKER]  # no partial iter_0000008
    assert "megatron_muon_files.json" in os.listdir(runs["save"] / SAVED)


@pytest.mark.multirank
def test_the_next_run_resumes_from_the_previous_checkpoint_bitwise(runs: dict[str, Any]) -> None:
    full, resumed = runs["full"], runs["resumed"]
    assert sorted(resumed.iterations) == list(range(SAVE_INTERVAL + 1, TRAIN_ITERS + 1))
    # Rank 0's grad norm of every step at full precision: iterations 1-8, then 5-12.
    repeated = FULL_AT - SAVE_INTERVAL
    assert (
        len(full.grad_norms) == FULL_AT and len(resumed.grad_norms) == TRAIN_ITERS - SAVE_INTERVAL
    )
    assert resumed.grad_norms[:repeated] == full.grad_norms[SAVE_INTERVAL:FULL_AT]
    for iteration in range(SAVE_INTERVAL + 1, FULL_AT + 1):
        assert (
            resumed.iterations[iteration]["grad norm"] == full.iterations[iteration]["grad norm"]
        ), iteration
    # Megatron's first log line after a start does not reset its loss sum: the second line after
    # the start prints the mean of both lines' losses, here and in the first run (iteration 2).
    for iteration in (SAVE_INTERVAL + 1, *range(SAVE_INTERVAL + 3, FULL_AT + 1)):
        assert resumed.iterations[iteration]["lm loss"] == full.iterations[iteration]["lm loss"]
    assert (runs["save"] / TRACKER).read_text().strip() == str(TRAIN_ITERS)
    for iteration in (FULL_AT, TRAIN_ITERS):
        saved = os.listdir(runs["save"] / f"iter_{iteration:07d}")
        assert "megatron_muon_files.json" in saved, saved


@pytest.mark.multirank
def test_a_flipped_bit_is_refused_on_every_rank_naming_the_file(runs: dict[str, Any]) -> None:
    refused: MegatronRun = runs["refused"]
    assert refused.returncode != 0
    assert refused.iterations == {}  # nothing trained on the damaged state
    directory = runs["copies"]["bit_flip"] / SAVED
    error = (
        f"IncompleteCheckpointError: checkpoint {directory} is damaged: __0_0.distcp does not "
        "have the SHA-256 it was saved with"
    )
    for rank, output in refused.rank_outputs.items():
        assert error in output, f"rank {rank}:\n{output[-3000:]}"


@pytest.mark.multirank
def test_a_pickle_naming_another_global_is_refused_on_every_rank_and_never_runs(
    runs: dict[str, Any],
) -> None:
    unsafe: MegatronRun = runs["unsafe"]
    assert unsafe.returncode != 0
    assert unsafe.iterations == {}
    metadata = runs["copies"]["payload"] / SAVED / ".metadata"
    error = f"UnsafeCheckpointError: {metadata}: refused to unpickle the global posix.system"
    for rank, output in unsafe.rank_outputs.items():
        assert error in output, f"rank {rank}:\n{output[-3000:]}"
        assert "--ckpt-trust-pickles" in output
    # The same check on args (a value DCP stores whole) and on a user's type, in this process
    # (without a process group each call raises its own error; the launch above showed every rank).
    from megatron_muon.checkpointing import UnsafeCheckpointError
    from megatron_muon.integrations.checkpoint_guards.pickles import check_checkpoint_pickles

    for case, where, name in (
        ("payload_args", "(item args)", "posix.system"),
        ("note", "(item args)", "tests.crafted_pickles.TrainerNote"),
    ):
        load = SimpleNamespace(load=str(runs["copies"][case]), ckpt_step=None)
        with pytest.raises(UnsafeCheckpointError, match=f"refused to unpickle the global {name}"):
            check_checkpoint_pickles(load)
        with pytest.raises(UnsafeCheckpointError, match=re.escape(where)):
            check_checkpoint_pickles(load)
    for case, marker in runs["markers"].items():
        assert not os.path.exists(marker), f"the payload of {case} ran"


@pytest.mark.multirank
def test_with_ckpt_trust_pickles_a_checkpoint_holding_other_types_resumes_bitwise(
    runs: dict[str, Any],
) -> None:
    full, trusted = runs["full"], runs["trusted"]
    assert sorted(trusted.iterations) == list(range(SAVE_INTERVAL + 1, TRAIN_ITERS + 1))
    repeated = FULL_AT - SAVE_INTERVAL
    assert trusted.grad_norms[:repeated] == full.grad_norms[SAVE_INTERVAL:FULL_AT]


@pytest.mark.multirank
def test_every_other_door_refuses_a_crafted_checkpoint_on_every_rank_and_no_payload_runs(
    runs: dict[str, Any],
) -> None:
    copies = runs["copies"]
    unsafe = "refused to unpickle the global posix.system"
    expected = {
        "pretrained": f"UnsafeCheckpointError: {copies['payload'] / SAVED / '.metadata'}: {unsafe}",
        "checkpoint_args": f"UnsafeCheckpointError: {copies['payload_args'] / SAVED}/",
        "torch_dist": (
            f"UnsafeCheckpointError: {copies['torch_dist'] / SAVED / 'common.pt'}: {unsafe}"
        ),
        "legacy": f"UnsafeCheckpointError: {copies['legacy'] / SAVED}: Megatron would read it as a "
        "'torch' checkpoint (an mp_rank_* entry",
    }
    for door, phrase in expected.items():
        run: MegatronRun = runs["doors"][door]
        assert run.returncode != 0, door  # not Megatron's sys.exit(): status 0, nothing trained
        assert run.iterations == {}, door
        for rank, output in run.rank_outputs.items():
            assert phrase in output, f"{door}, rank {rank}:\n{output[-3000:]}"
            if door == "checkpoint_args":
                assert f"(item args): {unsafe}" in output, f"rank {rank}:\n{output[-3000:]}"
            assert "--ckpt-trust-pickles" in output
    for case, marker in runs["markers"].items():
        assert not os.path.exists(marker), f"the payload of {case} ran"
    print({door: round(run.wall_s, 1) for door, run in runs["doors"].items()})  # launch costs


@pytest.mark.multirank
def test_with_ckpt_trust_pickles_the_other_doors_load_and_train(runs: dict[str, Any]) -> None:
    trusted: MegatronRun = runs["doors"]["trusted"]
    assert sorted(trusted.iterations) == [1, 2]  # --pretrained-checkpoint: a fine-tuning start
    output = trusted.rank_outputs[0]  # Megatron prints these on rank 0
    assert re.search(r"Setting \w+ to .* from checkpoint", output), output  # the args it read
    assert f"finetune with checkpoint in {runs['copies']['note']}" in output, output


@pytest.mark.multirank
def test_a_checkpoint_missing_a_tensor_is_still_refused_by_dcp_on_every_rank(
    runs: dict[str, Any],
) -> None:
    missing: MegatronRun = runs["doors"]["missing_key"]
    assert missing.returncode != 0
    assert missing.iterations == {}
    for rank, output in missing.rank_outputs.items():
        assert f"Missing key in checkpoint state_dict: {MISSING}" in output, f"rank {rank}"


# --------------------------------------------------------------------------------------------------
# the same check on more damage, without a launch of Megatron's loop each
# --------------------------------------------------------------------------------------------------


def _refusals(
    rank: int, world_size: int, loads: list[tuple[str, int | None]]
) -> list[tuple[str, float]]:
    """What ``check_checkpoint_files`` raised for each (``--load``, ``--ckpt-step``), and in how
    many seconds."""
    import time

    from megatron_muon.integrations.checkpoint_guards.integrity import check_checkpoint_files

    raised = []
    for load, ckpt_step in loads:
        start = time.monotonic()
        try:
            check_checkpoint_files(SimpleNamespace(load=load, ckpt_step=ckpt_step))
            raised.append(("nothing", time.monotonic() - start))
        except Exception as error:  # noqa: BLE001 - the test compares what every rank raised
            raised.append((f"{type(error).__name__}: {error}", time.monotonic() - start))
    return raised


@pytest.mark.multirank
def test_truncated_unfinished_or_fifo_checkpoints_and_a_damaged_tracker_are_refused_on_every_rank(
    runs: dict[str, Any],
) -> None:
    copies = runs["copies"]
    truncated = copies["truncated"] / SAVED
    shard_size = os.path.getsize(truncated / "__1_0.distcp")
    metadata_size = os.path.getsize(truncated / ".metadata")
    os.remove(truncated / "megatron_muon_files.json")  # as saved without install(): no hashes
    os.truncate(truncated / "__1_0.distcp", 600_000)
    os.truncate(copies["metadata"] / SAVED / ".metadata", 1000)
    (copies["empty_tracker"] / TRACKER).write_text("")
    # What a save that stopped before DCP's .metadata left (--ckpt-step names it).
    os.remove(copies["unfinished"] / SAVED / ".metadata")
    cases = [
        (
            "truncated",
            None,
            f"IncompleteCheckpointError: checkpoint {truncated} is damaged: __1_0.distcp holds "
            f"600000 bytes, its .metadata references {shard_size} (truncated)",
        ),
        ("metadata", None, f".metadata has 1000 bytes, {metadata_size} were written"),
        (
            "empty_tracker",
            None,
            f"CheckpointError: --load {copies['empty_tracker']}: its tracker "
            f"{copies['empty_tracker'] / TRACKER} holds '', not an iteration",
        ),
        ("unfinished", SAVE_INTERVAL, "is incomplete: no .metadata (its save did not finish)"),
        (
            "fifo",
            0,  # --ckpt-step 0: Megatron reads the tracker's iteration
            f"UnsafeCheckpointError: {copies['fifo'] / SAVED / 'fifo'}: refused (not a regular "
            "file (a FIFO))",
        ),
    ]
    loads = [(str(copies[case]), ckpt_step) for case, ckpt_step, _ in cases]
    for rank, raised in enumerate(run_on_ranks(_refusals, 2, loads, timeout=120)):
        for (case, _, phrase), (result, seconds) in zip(cases, raised, strict=True):
            assert phrase in result, (case, rank, result)
            assert seconds < 10, (case, rank, seconds)  # a FIFO opened would block for ever


# --------------------------------------------------------------------------------------------------
# --async-save (single process)
# --------------------------------------------------------------------------------------------------

_ARGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 4 --train-iters 5 "
    "--lr 0.01 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--no-gradient-accumulation-fusion --use-megatron-fsdp --ckpt-format fsdp_dtensor "
    "--optimizer muon --data-parallel-sharding-strategy optim_grads_params "
    "--save /tmp/unused --save-interval 4 "
)


def _validated(monkeypatch: pytest.MonkeyPatch, flags: str) -> argparse.Namespace:
    from megatron.training import arguments

    from megatron_muon.integrations import megatron_lm

    megatron_lm.install(cpu_stand_ins=False)
    # validate_args asks the GPU's compute capability under Megatron-FSDP.
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["pretrain", *flags.split()])
    return arguments.validate_args(arguments.parse_args())


def test_async_save_is_refused_at_start_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    persistent = "--async-save --use-persistent-ckpt-worker --async-strategy mcore"
    with pytest.raises(ValueError, match="--async-save with --optimizer muon --use-megatron-fsdp"):
        _validated(monkeypatch, _ARGS + persistent)
    # Without a persistent worker Megatron itself turns --async-save off: saves are synchronous.
    assert not _validated(monkeypatch, _ARGS + "--async-save").async_save

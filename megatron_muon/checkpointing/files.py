"""The directory of a megatron-muon checkpoint: whole or refused.

A checkpoint is what ``torch.distributed.checkpoint`` (DCP) writes, the data files
(``__<rank>_<i>.distcp``) and ``.metadata`` (which references every data file a load reads), plus
the completion marker ``megatron_muon_checkpoint.json``: the manifest (``manifest``'s description
of model and optimizer) and ``files``, every file of the checkpoint with its size and SHA-256.

Saving (``save_checkpoint`` runs these steps; each one that can fail on one rank ends in
``ranks.agree``, so every rank raises the same error):

1. every rank passes the same absolute path (compared before anything is written);
2. rank 0 creates ``<path>.incomplete`` with a token file; every rank must read that token there
   (``check_shared_directory``: ranks on node-local disks would write where no load finds them);
3. DCP writes the data files and ``.metadata``;
4. ``publish``: the files ``.metadata`` references are hashed (each rank a share of them), rank 0
   writes the marker and renames the directory to ``<path>`` (an existing checkpoint, with
   ``overwrite``, is first renamed to ``<path>.replaced`` and removed at the end).

Loading (``verify``): each rank reads the marker and ``.metadata``, checks that every file the
metadata references is listed, exists and has its size, and hashes ``.metadata`` and its share of
the data files, before any state is touched.

Format version 1 (checkpoints saved before the hashes were recorded): its marker maps each file
(every file rank 0 saw in the directory) to its size only. Such a checkpoint loads with every check
but the hashes: every file DCP's metadata references must be listed and present with its size,
which also refuses a version-1 save whose ranks wrote to different directories (its marker misses
their files). Bytes altered after the save without changing a size go unnoticed, as they did
when version 1 was current.

Cost of the hashes: each file is read once more, by one rank, at save and at load (measured in
docs/checkpoints.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from typing import Any

import torch.distributed as dist

from megatron_muon.checkpointing.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
)
from megatron_muon.checkpointing.ranks import agree
from megatron_muon.checkpointing.safe_unpickle import METADATA_NAME, read_metadata

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "INCOMPLETE_SUFFIX",
    "MARKER_NAME",
    "METADATA_NAME",
    "REPLACED_SUFFIX",
    "UNHASHED_VERSION",
    "check_shared_directory",
    "create_directory",
    "describe_files",
    "hashes_recorded",
    "publish",
    "read_marker",
    "verify",
]

FORMAT = "megatron_muon.fsdp_dtensor"
FORMAT_VERSION = 2  # 2: the marker's files carry SHA-256 and follow DCP's metadata
UNHASHED_VERSION = 1  # 1: the marker's files carry sizes only (name -> bytes); loaded unhashed
MARKER_NAME = "megatron_muon_checkpoint.json"
INCOMPLETE_SUFFIX = ".incomplete"
REPLACED_SUFFIX = ".replaced"
_TOKEN_PREFIX = ".megatron_muon_save_"
_MANIFEST_KEYS = ("iteration", "world_size", "params", "buffers", "optimizers", "has_scheduler")


# --------------------------------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------------------------------


def create_directory(path: str, overwrite: bool) -> str:
    """Rank 0: a fresh ``<path>.incomplete`` holding a token file; returns the token."""
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"checkpoint {path} exists (pass overwrite=True to replace)")
    temporary = path + INCOMPLETE_SUFFIX
    shutil.rmtree(temporary, ignore_errors=True)  # a previous save that did not finish
    os.makedirs(temporary)
    token = uuid.uuid4().hex
    with open(os.path.join(temporary, _TOKEN_PREFIX + token), "w") as handle:
        handle.write(token)
    return token


def check_shared_directory(path: str, token: str) -> None:
    """This rank sees the directory rank 0 created (``create_directory``'s token is there)."""
    temporary = path + INCOMPLETE_SUFFIX
    if not os.path.isfile(os.path.join(temporary, _TOKEN_PREFIX + token)):
        raise CheckpointError(
            f"{temporary}, created by rank 0, is not visible on rank {dist.get_rank()}: every "
            "rank must save to one shared directory (a node-local disk would keep this rank's "
            "shards where no load finds them)"
        )


def _sha256(file: str) -> str:
    with open(file, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _referenced_files(directory: str, trust_pickles: bool = False) -> list[str]:
    """``.metadata`` (read restricted: ``safe_unpickle``) and every data file it references,
    sorted."""
    metadata = read_metadata(directory, trust_pickles=trust_pickles)
    names = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return sorted(names | {METADATA_NAME})


def _describe_share(directory: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of this rank's share of ``names`` (every world_size-th, from its rank)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    described = {}
    for name in names[rank::world_size]:
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            raise IncompleteCheckpointError(
                f"{name}, referenced by DCP's metadata, is missing from {directory} on rank {rank}"
            )
        described[name] = {"size": os.path.getsize(file), "sha256": _sha256(file)}
    return described


def describe_files(directory: str) -> dict[str, dict[str, Any]]:
    """``.metadata`` and every data file it references -> size and SHA-256. Collective.

    Rank 0 reads the names from DCP's metadata; each rank hashes every world_size-th file. Every
    rank returns the whole listing, or raises the same error (a file missing, unreadable).
    """
    error: BaseException | None = None
    names = None
    if dist.get_rank() == 0:
        try:
            names = _referenced_files(directory)
        except OSError as caught:
            error = caught
    names = agree(error, names)[0]
    error, share = None, {}
    try:
        share = _describe_share(directory, names)
    except (OSError, CheckpointError) as caught:
        error = caught
    shares = agree(error, share)
    return dict(sorted((name, entry) for part in shares for name, entry in part.items()))


def publish(path: str, manifest: dict[str, Any], overwrite: bool) -> None:
    """Marker, then ``<path>.incomplete`` -> ``<path>``, once DCP has written. Collective.

    Raises on every rank when a file DCP's metadata references is missing or the rename fails.
    """
    temporary = path + INCOMPLETE_SUFFIX
    files = describe_files(temporary)
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            _write_marker(temporary, {**manifest, "files": dict(sorted(files.items()))})
            _rename_into_place(temporary, path, overwrite)
        except OSError as caught:
            error = caught
    agree(error)


def _write_marker(temporary: str, manifest: dict[str, Any]) -> None:
    for name in os.listdir(temporary):
        if name.startswith(_TOKEN_PREFIX):
            os.remove(os.path.join(temporary, name))
    with open(os.path.join(temporary, MARKER_NAME), "w") as handle:
        json.dump({"format": FORMAT, "version": FORMAT_VERSION, **manifest}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_directory(temporary)


def _rename_into_place(temporary: str, path: str, overwrite: bool) -> None:
    previous = None
    if os.path.exists(path):
        if not overwrite:
            raise FileExistsError(f"checkpoint {path} appeared during the save; not replacing it")
        previous = path + REPLACED_SUFFIX
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(path, previous)
    os.rename(temporary, path)
    _fsync_directory(os.path.dirname(os.path.abspath(path)))
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)


def _fsync_directory(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------


def _leftovers(path: str) -> str:
    """What an interrupted save or overwrite left next to a missing ``path``, in words."""
    notes = []
    whole = {}
    for suffix, what in (
        (INCOMPLETE_SUFFIX, "a save that did not finish"),
        (REPLACED_SUFFIX, "the checkpoint an overwrite set aside"),
    ):
        if os.path.isdir(path + suffix):
            whole[suffix] = os.path.isfile(os.path.join(path + suffix, MARKER_NAME))
            marker = "with" if whole[suffix] else "without"
            notes.append(f"{path + suffix} exists: {what}, {marker} a completion marker")
    if whole.get(INCOMPLETE_SUFFIX) and REPLACED_SUFFIX in whole:
        notes.append(
            f"an overwrite stopped between its two renames: rename {path + INCOMPLETE_SUFFIX} "
            f"(the new checkpoint) or {path + REPLACED_SUFFIX} (the old one) to {path} to load it"
        )
    return f" ({'; '.join(notes)})" if notes else ""


def _is_hashed_entry(entry: Any) -> bool:
    return isinstance(entry, dict) and {"size", "sha256"} <= entry.keys()


def _is_size(entry: Any) -> bool:
    return isinstance(entry, int) and not isinstance(entry, bool) and entry >= 0


# What a marker's ``files`` maps each name to, per format version.
_FILE_ENTRY = {FORMAT_VERSION: _is_hashed_entry, UNHASHED_VERSION: _is_size}


def read_marker(path: str) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, or the error naming what is wrong with it."""
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(
            f"checkpoint directory {path} does not exist{_leftovers(path)}"
        )
    marker = os.path.join(path, MARKER_NAME)
    if not os.path.isfile(marker):
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete: no completion marker {MARKER_NAME} (the save was "
            "interrupted, or this is not a megatron_muon checkpoint)"
        )
    try:
        with open(marker) as handle:
            manifest = json.load(handle)
    except (OSError, ValueError) as error:
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete: its marker {MARKER_NAME} is unreadable ({error})"
        ) from None
    if not isinstance(manifest, dict):
        raise IncompleteCheckpointError(f"checkpoint {path}: its marker {MARKER_NAME} is damaged")
    version = manifest.get("version")
    if manifest.get("format") != FORMAT or type(version) is not int or version not in _FILE_ENTRY:
        raise CheckpointMismatchError(
            f"checkpoint {path} has format {manifest.get('format')} version {version}; this "
            f"reader expects {FORMAT} version {FORMAT_VERSION} (or {UNHASHED_VERSION})"
        )
    missing = [key for key in (*_MANIFEST_KEYS, "files") if key not in manifest]
    files = manifest.get("files")
    if missing or not isinstance(files, dict) or not all(map(_FILE_ENTRY[version], files.values())):
        what = f"lacks {missing}" if missing else "has a damaged file list"
        raise IncompleteCheckpointError(
            f"checkpoint {path}: its marker {MARKER_NAME} {what} (damaged, or written by "
            "another program)"
        )
    if version == UNHASHED_VERSION:
        manifest["files"] = {name: {"size": size} for name, size in files.items()}
    return manifest


def hashes_recorded(manifest: dict[str, Any]) -> bool:
    """Whether ``read_marker``'s ``manifest`` lists SHA-256 hashes (format version 2), so that
    ``verify`` checks them; version 1 markers list sizes only."""
    return manifest["version"] == FORMAT_VERSION


def verify(path: str, manifest: dict[str, Any], *, trust_pickles: bool = False) -> None:
    """Every file of checkpoint ``path`` is there, whole and unaltered. Reads no state.

    Every rank checks sizes and ``.metadata``'s hash, then every file ``.metadata`` references is
    listed in the marker; each rank hashes its share of the data files. Collective only through
    the caller's ``agree``. A version 1 marker (``read_marker``'s ``manifest``) has no hashes:
    sizes and the listing are checked, nothing is hashed. ``.metadata`` is read restricted
    (``safe_unpickle``) unless ``trust_pickles``.
    """
    files = manifest["files"]
    hashed = hashes_recorded(manifest)
    for name, entry in files.items():
        _check_size(path, name, entry["size"])
    if METADATA_NAME not in files:
        raise IncompleteCheckpointError(f"checkpoint {path}: its marker does not list .metadata")
    if hashed:
        _check_hash(path, METADATA_NAME, files[METADATA_NAME]["sha256"])
    referenced = _referenced_files(path, trust_pickles)
    unlisted = [name for name in referenced if name not in files]
    if unlisted:
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete: DCP's metadata references {unlisted}, which its "
            f"marker does not list (the save lost them)"
        )
    if not hashed:
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for name in referenced[rank::world_size]:
        if name != METADATA_NAME:
            _check_hash(path, name, files[name]["sha256"])


def _check_size(path: str, name: str, size: int) -> None:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        writer = ""
        if name.startswith("__") and name.endswith(".distcp"):
            writer = f" (rank {name[2:].split('_')[0]}'s shards)"
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete: {name}{writer} is missing"
        )
    if os.path.getsize(file) != size:
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete: {name} has {os.path.getsize(file)} bytes, "
            f"{size} were written"
        )


def _check_hash(path: str, name: str, expected: str) -> None:
    if _sha256(os.path.join(path, name)) != expected:
        raise IncompleteCheckpointError(
            f"checkpoint {path} is damaged: {name} does not have the SHA-256 it was saved with "
            "(its bytes changed since the save)"
        )

"""Checkpoints crafted as an attacker with write access to the directory would craft them.

A pickle replaced by one whose ``__reduce__`` runs a shell command (``Payload``: ``touch`` of a
marker file, so a test sees whether it ran), or by one holding a harmless type outside the
allowlist (``TrainerNote``: what a user's own ``extra`` may hold); the checkpoint's file listing
(``megatron_muon_checkpoint.json`` or Megatron's ``megatron_muon_files.json``: size and SHA-256
per file) rewritten to match, as an attacker would.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shlex
from typing import Any

import torch


class Payload:
    """Unpickled, runs ``touch marker`` (``os.system``)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


class TrainerNote:
    """A user's own type: harmless, and not on the allowlist."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TrainerNote) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


def _metadata(directory: str) -> Any:
    with open(os.path.join(directory, ".metadata"), "rb") as handle:
        return pickle.load(handle)  # the test's own, unmodified save


def _relist(directory: str, listing: str, names: list[str]) -> None:
    """``names``' sizes and SHA-256 in the listing, as the attacker rewrites them."""
    path = os.path.join(directory, listing)
    with open(path) as handle:
        content = json.load(handle)
    for name in names:
        with open(os.path.join(directory, name), "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        content["files"][name] = {
            "size": os.path.getsize(os.path.join(directory, name)),
            "sha256": digest,
        }
    with open(path, "w") as handle:
        json.dump(content, handle)


def replace_metadata(directory: str, listing: str, replacement: Any) -> None:
    """``.metadata`` := ``pickle.dumps(replacement)``."""
    with open(os.path.join(directory, ".metadata"), "wb") as handle:
        pickle.dump(replacement, handle)
    _relist(directory, listing, [".metadata"])


def note_in_metadata(directory: str, listing: str, note: TrainerNote) -> None:
    """The real ``.metadata`` with ``note`` in its ``planner_data`` (a field DCP carries)."""
    metadata = _metadata(directory)
    metadata.planner_data = {"note": note}
    replace_metadata(directory, listing, metadata)


def replace_item(directory: str, listing: str, key: str, value: Any, nested: bool) -> str:
    """The value DCP stored whole under ``key`` := ``torch.save(value)`` (``nested``: of
    ``torch.save(value)``'s bytes, as ``megatron_muon.checkpointing`` stores its small objects),
    appended to the item's data file and pointed to by ``.metadata``. Returns the file's name."""
    metadata = _metadata(directory)
    (index,) = [i for i in metadata.storage_data if i.fqn == key]
    info = metadata.storage_data[index]
    blob = io.BytesIO()
    if nested:
        inner = io.BytesIO()
        torch.save(value, inner)
        value = inner.getvalue()
    torch.save(value, blob)
    file = os.path.join(directory, info.relative_path)
    info.offset = os.path.getsize(file)
    info.length = len(blob.getvalue())
    with open(file, "ab") as handle:
        handle.write(blob.getvalue())
    replace_metadata(directory, listing, metadata)
    _relist(directory, listing, [info.relative_path])
    return info.relative_path


def reads_as_torch_dist(directory: str, listing: str, replacement: Any) -> str:
    """``metadata.json`` and ``common.pt`` (``torch.save(replacement)``) beside ``.metadata``:
    megatron-core's ``_get_checkpoint_format`` then picks its ``torch_dist`` reader, which reads
    ``common.pt`` with ``torch.load`` at torch's default. Returns ``common.pt``'s path."""
    with open(os.path.join(directory, "metadata.json"), "w") as handle:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, handle)
    torch.save(replacement, os.path.join(directory, "common.pt"))
    _relist(directory, listing, ["metadata.json", "common.pt"])
    return os.path.join(directory, "common.pt")


def reads_as_legacy(directory: str, listing: str, replacement: Any) -> None:
    """An ``mp_rank_00/model_optim_rng.pt`` (``torch.save(replacement)``) in the directory:
    megatron-core picks its legacy reader (``torch.load`` of it; on failure ``sys.exit()``)."""
    os.makedirs(os.path.join(directory, "mp_rank_00"))
    name = os.path.join("mp_rank_00", "model_optim_rng.pt")
    torch.save(replacement, os.path.join(directory, name))
    _relist(directory, listing, [name])


def reference_fifo(directory: str, listing: str, key: str) -> str:
    """The item ``key`` of ``.metadata`` read from ``fifo``, a FIFO in the directory (an
    ``open()`` of it blocks until a writer comes). Returns the FIFO's path."""
    metadata = _metadata(directory)
    (info,) = [info for index, info in metadata.storage_data.items() if index.fqn == key]
    info.relative_path = "fifo"
    replace_metadata(directory, listing, metadata)
    os.mkfifo(os.path.join(directory, "fifo"))
    return os.path.join(directory, "fifo")


def drop_entry(directory: str, listing: str, key: str) -> None:
    """``.metadata`` without ``key`` (its entry and its storage references): a checkpoint missing
    one tensor, every pickle allowlisted."""
    metadata = _metadata(directory)
    del metadata.state_dict_metadata[key]
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != key}
    replace_metadata(directory, listing, metadata)

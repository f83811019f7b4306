"""A DCP checkpoint directory read and written whole in one process, its pickles read restricted.

Both formats are DCP directories of global tensors (every TP, EP and DP shard is a chunk of one
global tensor in ``.metadata``), so one process reads any of them whole, whatever layout saved it,
and writes one that any layout loads: no process group, no collective. Non-tensor values (Megatron's
``args``, the scheduler, param-group fields, ...) are pickles: each is read by
``checkpointing.safe_unpickle``'s restricted reader (``load_items``), never by DCP's own
``torch.load(weights_only=False)``; ``.metadata`` likewise (``read_metadata``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata

from megatron_muon.checkpointing.safe_unpickle import (
    RestrictedFileSystemReader,
    load_items,
    read_metadata,
)

__all__ = ["DcpFiles", "write_checkpoint"]


class DcpFiles:
    """One DCP checkpoint directory: its keys, and its values read on demand."""

    def __init__(self, directory: str) -> None:
        if not os.path.isfile(os.path.join(directory, ".metadata")):
            raise FileNotFoundError(f"{directory} holds no DCP checkpoint (no .metadata)")
        self.directory = directory
        self.metadata = read_metadata(directory)
        entries = self.metadata.state_dict_metadata
        self.tensor_keys = {
            key: entry
            for key, entry in entries.items()
            if isinstance(entry, dcp_metadata.TensorStorageMetadata)
        }
        self.object_keys = {
            key
            for key, entry in entries.items()
            if isinstance(entry, dcp_metadata.BytesStorageMetadata)
        }

    def tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The global tensors of ``keys`` (CPU, their saved dtype), every chunk read."""
        state: dict[str, Any] = {}
        for key in keys:
            entry = self.tensor_keys[key]
            state[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        if state:
            dcp.load(
                state,
                storage_reader=RestrictedFileSystemReader(self.directory),
                planner=DefaultLoadPlanner(),
                no_dist=True,
            )
        return state

    def objects(self, keys: list[str]) -> dict[str, Any]:
        """The values stored whole under ``keys``, each read restricted."""
        return load_items(self.directory, keys, self.metadata) if keys else {}


def write_checkpoint(directory: str, values: dict[str, Any]) -> None:
    """Writes ``values`` (flat ``{key: tensor or object}``; no nested dict or list is flattened)
    as one DCP checkpoint, one process.

    Raises:
        FileExistsError: ``directory`` exists and is not empty (nothing is overwritten).
    """
    if os.path.isdir(directory) and os.listdir(directory):
        raise FileExistsError(f"{directory} exists and is not empty: nothing written")
    os.makedirs(directory, exist_ok=True)
    planner = _WholeObjectsPlanner(values)
    dcp.save(values, storage_writer=FileSystemWriter(directory), planner=planner, no_dist=True)


class _WholeObjectsPlanner(DefaultSavePlanner):
    """DCP's default save planner, keys as given (no flattening), each object pickled as the
    caller gave it: through DCP's own lookup a nested dict's keys come back as strings
    (measured, torch 2.14: ``[{0: 1}]`` saved, ``[{"0": 1}]`` read), and LayerWise's common
    state is keyed by its children's int indices (``{0: ..., 1: ...}``; Megatron's load refuses
    it keyed ``"0"``, ``"1"``: "Expected 2 entries in state dict, but got 4")."""

    def __init__(self, values: dict[str, Any]) -> None:
        super().__init__(flatten_state_dict=False)
        self._values = values

    def lookup_object(self, index: Any) -> Any:
        value = self._values.get(index.fqn)
        return super().lookup_object(index) if torch.is_tensor(value) else value

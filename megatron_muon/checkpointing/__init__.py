"""Distributed checkpoints of model + optimizer under Megatron-FSDP (torch.distributed.checkpoint).
May import ``optimizers``, ``engine``, ``newton_schulz`` and ``common``.

Two functions for custom trainers::

    save_checkpoint(path, model_chunks, optimizer, scheduler, iteration=it, extra={...})
    loaded = load_checkpoint(path, model_chunks, optimizer, scheduler)  # loaded.iteration, .extra

The layout is Megatron's ``fsdp_dtensor`` one: everything keyed by parameter name, every tensor
that belongs to a parameter a DTensor with the parameter's global shape and placements. Each rank
writes exactly its own rows, and a load at another data-parallel size or sharding strategy reads
exactly the rows it now holds: checkpoints reshard.

Modules, one concept each:

- ``save_load``: ``save_checkpoint`` / ``load_checkpoint``, the order of steps that keeps ranks in
  step;
- ``fsdp_dtensor``: what is checkpointed (named params, buffers, optimizer state, pickled small
  objects) in Megatron's ``fsdp_dtensor`` layout;
- ``optimizer_state``: state for every param on every rank without a step
  (``ensure_optimizer_state``), the leaf torch optimizers behind megatron-core's wrappers;
- ``row_chunks``: DCP chunk metadata of Megatron-FSDP's uneven and empty row shards;
- ``manifest``: model and optimizer in words, compared at a load;
- ``files``: the completion marker, whole-or-refused saves, file verification at a load;
- ``safe_unpickle``: the one allowlist of what a checkpoint may unpickle, and the restricted
  readers (a checkpoint from elsewhere runs no code when loaded);
- ``rng``: each rank's RNG states;
- ``ranks``, ``errors``: every rank raises the same error before any collective.

Invariants: **rank-symmetric state** (every rank holds state for every param of its optimizers
before a save or a load); **whole or refused** (a save that cannot be whole raises the same error
on every rank before writing; an interrupted save leaves no ``<path>``); **nothing half-loaded**
(every rank checks the marker, every file DCP's metadata references and the compatibility of
model and optimizer before anything is read, and all ranks raise the same error).

Limits: tensor-, pipeline- and expert-parallel size 1 (names are the model chunk's own parameter
names, as Megatron's ``get_global_unique_param_name`` gives them when PP = EP = 1, and TP shards of
one param would share a name); RNG states are restored only when the data-parallel world size is
unchanged (elsewhere there is no rank-to-rank correspondence, and
``LoadedCheckpoint.rng_restored`` is False).
"""

from __future__ import annotations

from megatron_muon.checkpointing.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from megatron_muon.checkpointing.files import INCOMPLETE_SUFFIX, MARKER_NAME
from megatron_muon.checkpointing.fsdp_dtensor import named_optimizer_params
from megatron_muon.checkpointing.optimizer_state import ensure_optimizer_state, leaf_optimizers
from megatron_muon.checkpointing.save_load import (
    LoadedCheckpoint,
    SavedCheckpoint,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "INCOMPLETE_SUFFIX",
    "MARKER_NAME",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "LoadedCheckpoint",
    "UnsafeCheckpointError",
    "SavedCheckpoint",
    "ensure_optimizer_state",
    "leaf_optimizers",
    "load_checkpoint",
    "named_optimizer_params",
    "save_checkpoint",
]

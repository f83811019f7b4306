"""Save and load orchestration: the two public functions, in the order that keeps ranks in step.

A save: every rank checks its part (iteration, the params it holds; rank 0 pickles ``extra``, the
scheduler state and the param groups) and all agree on the outcome, the path and the param list
(``ranks``); rank 0 creates ``<path>.incomplete``, which every rank must see (``files``); state is
made rank-symmetric (``optimizer_state``), each DTensor gets its true row chunk (``row_chunks``),
DCP writes, and ``files.publish`` writes the completion marker and renames the directory.

A load: every rank reads the marker, compares the manifest with its model and optimizer
(``manifest``) and verifies the files, all agree, and only then DCP reads in place; param groups,
the scheduler and (at an unchanged world size) the RNGs are restored, and the main weights are
installed into Megatron-FSDP's compute weights.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from megatron_muon.checkpointing import files, fsdp_dtensor, rng, safe_unpickle
from megatron_muon.checkpointing.errors import CheckpointError
from megatron_muon.checkpointing.files import INCOMPLETE_SUFFIX
from megatron_muon.checkpointing.fsdp_dtensor import (
    Inventory,
    as_chunks,
    dcp_state_dict,
    from_bytes,
    param_groups_by_name,
    restore_param_groups,
    to_bytes,
)
from megatron_muon.checkpointing.manifest import check_matches, manifest_body
from megatron_muon.checkpointing.optimizer_state import ensure_optimizer_state
from megatron_muon.checkpointing.ranks import agree, agree_on_ranks
from megatron_muon.checkpointing.row_chunks import attach_row_chunks
from megatron_muon.common.console import print_rank_0
from megatron_muon.common.megatron_fsdp_compat import unwrap_megatron_fsdp

__all__ = ["LoadedCheckpoint", "SavedCheckpoint", "load_checkpoint", "save_checkpoint"]


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    """What ``save_checkpoint`` wrote: the directory, its total bytes (on rank 0; 0 elsewhere), and
    this rank's wall seconds."""

    path: str
    num_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    """What ``load_checkpoint`` restored besides model and optimizer state."""

    iteration: int
    extra: Any
    saved_world_size: int
    rng_restored: bool
    seconds: float


def save_checkpoint(
    path: str | os.PathLike[str],
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Any,
    scheduler: Any = None,
    *,
    iteration: int,
    extra: Any = None,
    overwrite: bool = False,
) -> SavedCheckpoint:
    """Saves model, optimizer, scheduler, iteration, RNG and ``extra`` to directory ``path``.

    Collective over the default process group: every rank calls it with its own shards. Each rank
    writes only the rows it holds (``__<rank>_0.distcp``); the completion marker and the rename to
    ``path`` happen after all ranks finished, so an interrupted save leaves only
    ``<path>.incomplete``, which never loads.

    Args:
        path: checkpoint directory to create (its parent must exist or be creatable).
        model_chunks: the Megatron-FSDP-wrapped model (``MegatronFSDP`` or megatron-core's
            ``FullyShardedDataParallel``), a list of chunks, or a plain module.
        optimizer: a torch optimizer (ShardedMuon, AdamW, ...), a list of them, or a megatron-core
            ``ChainedOptimizer`` / ``MegatronOptimizer`` over them.
        scheduler: anything with ``state_dict()`` / ``load_state_dict()`` (torch LR scheduler,
            Megatron's ``OptimizerParamScheduler``), or None.
        iteration: the training iteration the checkpoint resumes after.
        extra: any picklable object (data loader position, config, ...), rank 0's copy is kept.
        overwrite: replace an existing checkpoint at ``path`` (after the new one is complete).

    Returns:
        The directory (absolute), its size in bytes (counted on rank 0, 0 on the others) and the
        seconds the save took on this rank.

    Raises (on every rank alike, before anything is written unless it is an I/O error):
        ValueError: ``iteration`` is not a non-negative int; a param the optimizer holds is not
            one of ``model_chunks``'.
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        CheckpointError: the ranks passed different paths or hold different params, or a rank
            cannot see the directory rank 0 created.
        Any error of pickling ``extra`` or the scheduler's state (rank 0's, on every rank).
    """
    start = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    rank = dist.get_rank()
    error: BaseException | None = None
    inventory: Inventory | None = None
    common: dict[str, Any] = {}
    try:
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")
        inventory = fsdp_dtensor.inventory(as_chunks(model_chunks), optimizer)
        if rank == 0:
            common = _rank0_common(inventory, iteration, extra, scheduler)
    except Exception as caught:  # noqa: BLE001 - every rank must learn of it before a collective
        error = caught
    agree_on_ranks(error, path, [] if inventory is None else inventory.names())
    assert inventory is not None

    error, token = None, None
    if rank == 0:
        try:
            token = files.create_directory(path, overwrite)
        except OSError as caught:
            error = caught
    token = agree(error, token)[0]
    error = None
    try:
        files.check_shared_directory(path, token)
    except CheckpointError as caught:
        error = caught
    agree(error)

    ensure_optimizer_state(inventory.leaves)
    common[f"rng.rank{rank}"] = to_bytes(rng.capture_rng())
    state_dict = dcp_state_dict(inventory)
    state_dict["common"] = common
    attach_row_chunks(inventory.params, state_dict["optimizer"]["state"])
    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(path + INCOMPLETE_SUFFIX))
    manifest = manifest_body(inventory, int(iteration), scheduler is not None)
    files.publish(path, manifest, overwrite)
    num_bytes = 0
    if rank == 0:
        num_bytes = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return SavedCheckpoint(path=path, num_bytes=num_bytes, seconds=time.perf_counter() - start)


def _rank0_common(
    inventory: Inventory, iteration: int, extra: Any, scheduler: Any
) -> dict[str, bytes]:
    """What rank 0 alone writes (identical on every rank; DCP would keep an arbitrary rank's
    copy), pickled now, before any collective: an unpicklable ``extra`` fails here."""
    return {
        "iteration": to_bytes(int(iteration)),
        "extra": to_bytes(extra),
        "scheduler": to_bytes(None if scheduler is None else scheduler.state_dict()),
        "param_groups": to_bytes(param_groups_by_name(inventory)),
    }


def load_checkpoint(
    path: str | os.PathLike[str],
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Any,
    scheduler: Any = None,
    *,
    load_rng: bool = True,
    trust_pickles: bool = False,
) -> LoadedCheckpoint:
    """Loads a checkpoint of ``save_checkpoint`` into the live model and optimizer, in place.

    Collective over the default process group. Works at any data-parallel size and sharding
    strategy: each rank reads exactly the rows it holds now. Checks first, on every rank, that the
    checkpoint is complete and matches the model (param names, shapes, dtypes) and the optimizer
    (which state each param holds, param groups); on any difference every rank raises the same
    ``CheckpointError`` and nothing is changed. Afterwards the main weights are installed into
    Megatron-FSDP's compute weights (as after an optimizer step), param-group hyperparameters and
    the scheduler are restored, and, when the world size is unchanged and ``load_rng``, the RNGs.

    Every pickle of the checkpoint (DCP's ``.metadata``, the scheduler, param groups, RNG states,
    ``extra``) is read by a restricted unpickler that admits only the types such checkpoints hold
    (``safe_unpickle.allowed_globals``), checked on every rank before anything loads: a pickle
    naming another global is refused, naming the file and the global, and nothing of it runs.
    ``trust_pickles=True`` reads them unrestricted, for a checkpoint you trust whose ``extra``
    holds your own types: unpickling can run any code the checkpoint's writer chose.

    The checks cover every failure known before reading (missing, incomplete, mismatched); an I/O
    error during DCP's read itself (disk failure) raises on all ranks but may leave tensors partly
    overwritten: load again, or restart.

    Returns:
        The saved iteration and ``extra``, the world size at save time, whether RNGs were restored.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist (what an interrupted save or overwrite
            left next to it is named).
        IncompleteCheckpointError: no or a damaged completion marker, or a file missing,
            truncated or altered (SHA-256; a format version 1 checkpoint, saved before hashes
            were recorded, loads with sizes checked only, which rank 0 prints).
        CheckpointMismatchError: saved from a different model or optimizer (the message names it).
        UnsafeCheckpointError: a pickle of the checkpoint names a global outside the allowlist
            (file and global named); not with ``trust_pickles``.
        CheckpointError: the ranks passed different paths or hold different params.
    """
    start = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    chunks = as_chunks(model_chunks)
    error: BaseException | None = None
    inventory: Inventory | None = None
    manifest: dict[str, Any] = {}
    try:
        inventory = fsdp_dtensor.inventory(chunks, optimizer)
        manifest = files.read_marker(path)
        check_matches(path, manifest, inventory, scheduler)
        files.verify(path, manifest, trust_pickles=trust_pickles)
    except Exception as caught:  # noqa: BLE001 - every rank must learn of it before a collective
        error = caught
    agree_on_ranks(error, path, [] if inventory is None else inventory.names())
    assert inventory is not None
    if not trust_pickles:  # after verify's agree: each rank hashed only its share of the files
        try:
            safe_unpickle.check_pickles(path)
        except Exception as caught:  # noqa: BLE001 - every rank must learn of it
            error = caught
        agree(error)
    if not files.hashes_recorded(manifest):
        print_rank_0(
            f"megatron-muon: checkpoint {path} is format version {manifest['version']} (saved "
            "before SHA-256 hashes were recorded): its files were checked for presence and size, "
            "hashes were not verified"
        )

    world_size, rank = dist.get_world_size(), dist.get_rank()
    restore_rng = load_rng and manifest["world_size"] == world_size
    if load_rng and not restore_rng and rank == 0:
        warnings.warn(
            f"checkpoint {path} was saved by {manifest['world_size']} ranks, this run has "
            f"{world_size}: RNG states are not restored",
            stacklevel=2,
        )
    ensure_optimizer_state(inventory.leaves)
    common: dict[str, Any] = {
        "iteration": b"",
        "extra": b"",
        "scheduler": b"",
        "param_groups": b"",
    }
    if restore_rng:
        common[f"rng.rank{rank}"] = b""
    state_dict = dcp_state_dict(inventory)
    state_dict["common"] = common
    attach_row_chunks(inventory.params, state_dict["optimizer"]["state"])
    if trust_pickles:
        dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path))
    else:
        dcp.load(
            state_dict,
            storage_reader=safe_unpickle.RestrictedFileSystemReader(path),
            planner=safe_unpickle.RestrictedLoadPlanner(),
        )
    _restore_state_objects(inventory, state_dict["optimizer"]["state"])

    loaded = {
        key: from_bytes(value, f"{path} (common.{key})", trust_pickles=trust_pickles)
        for key, value in state_dict["common"].items()
    }
    restore_param_groups(inventory, loaded["param_groups"])
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    if restore_rng:
        rng.restore_rng(loaded[f"rng.rank{rank}"])
    _install_model_weights(chunks)
    return LoadedCheckpoint(
        iteration=loaded["iteration"],
        extra=loaded["extra"],
        saved_world_size=manifest["world_size"],
        rng_restored=restore_rng,
        seconds=time.perf_counter() - start,
    )


def _restore_state_objects(inventory: Inventory, loaded: dict[str, dict[str, Any]]) -> None:
    """Puts the loaded non-tensor state values (SOAP's Python-int ``step``) into the live state:
    DCP loads tensors in place but replaces other values in its own (copied) dicts."""
    for name, param in inventory.params:
        if name in inventory.param_owner:
            live = inventory.param_owner[name][0].state[param]
            for key, value in loaded[name].items():
                if not torch.is_tensor(value):
                    live[key] = value


def _install_model_weights(chunks: list[nn.Module]) -> None:
    """Makes the forward read the (loaded) main weights. Collective over each chunk's DP group.

    ``install_optimized_model_weights`` copies them into the compute weights' own shard; gathered
    copies that Megatron-FSDP keeps between forwards (every bucket under ``optim``/``optim_grads``,
    where the compute weights are whole; the non-FSDP-unit buckets under ``optim_grads_params``)
    are marked stale by ``synchronize_param_gather`` and gathered anew by ``start_param_sync`` or
    the next forward, as after an optimizer step. Without this, an eval after loading into a
    trained model computes the trained model's loss, not the checkpoint's.
    """
    for chunk in chunks:
        fsdp = unwrap_megatron_fsdp(chunk)
        if fsdp is not None:
            fsdp.install_optimized_model_weights()
            fsdp.synchronize_param_gather()
            fsdp.start_param_sync()

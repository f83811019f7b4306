"""Distributed checkpoints of model + optimizer under Megatron-FSDP (torch.distributed.checkpoint).

Two functions for custom trainers::

    save_checkpoint(path, model_chunks, optimizer, scheduler, iteration=it, extra={...})
    loaded = load_checkpoint(path, model_chunks, optimizer, scheduler)  # loaded.iteration, .extra

The layout is Megatron's ``fsdp_dtensor`` one: everything is keyed by parameter name, and every
tensor that belongs to a parameter is stored as a DTensor with the parameter's **global** shape and
placements (``Shard(0)`` by whole rows over the data-parallel mesh, or ``Replicate`` under
``no_shard``):

- ``model.<name>``: the main (optimizer) weights Megatron-FSDP hands the optimizer; persistent
  buffers of the module as plain tensors;
- ``optimizer.state.<name>.<key>``: ``momentum_buffer`` (Muon), ``exp_avg`` / ``exp_avg_sq`` /
  ``step`` (Adam, AdamW);
- ``common.param_groups`` (hyperparameters, params by name), ``common.scheduler``,
  ``common.iteration``, ``common.extra`` (written once, by rank 0) and ``common.rng.rank<r>`` (each
  rank's RNG states), pickled whole.

Megatron-FSDP's row shards are uneven and often empty, while DTensor's own chunk metadata assumes
``torch.chunk`` splits (REFERENCE.md section 3). Before DCP plans a save or a load, each DTensor
gets its true chunk, as megatron_fsdp's ``preprocess_state_dict_for_uneven_dtensor`` does, but
computed from the param's ``megatron_fsdp_slice`` without communication (megatron_fsdp's
per-tensor ``all_gather_object`` took 80% of a demo model's save + load) and shared by the param
and its state tensors; params without that attribute fall back to megatron_fsdp's gather. So each
rank writes exactly its own rows (nothing for an empty shard), and a load at another
data-parallel size or sharding strategy reads exactly the rows it now holds: checkpoints reshard.

Invariants this module keeps:

- **Rank-symmetric state.** Every rank holds state for every param of its optimizers before a save
  or a load (``ensure_optimizer_state``). AdamW creates state lazily, and a rank with 0 rows of a
  param never gets a grad: its keys would differ from its peers', which hangs megatron_fsdp's
  per-DTensor collectives and Megatron's fsdp_dtensor save (REFERENCE.md section 8) and here would
  leave the rank's rows of that state unwritten. State is created without an optimizer step (a
  zero-grad step would apply decoupled weight decay: the dummy-step hazard, section 5), and Adam's
  per-param ``step`` is set to the real count, the maximum over the param's data-parallel mesh.
- **Whole or refused** (``megatron_muon.checkpointing.files``). Every rank checks its part of a save
  (iteration, the params it holds, and, on rank 0, the pickled ``extra``, scheduler state and
  param groups) before the first collective, and all ranks agree on the outcome, on the path and
  on the param list; rank 0's ``<path>.incomplete`` must be visible to every rank; DCP writes
  there; the completion marker ``megatron_muon_checkpoint.json`` lists every file DCP's metadata
  references, with its size and SHA-256, and the directory is renamed to ``<path>``. An
  interrupted save leaves no ``<path>``.
- **Nothing half-loaded.** Before anything is read, every rank checks the marker, every file
  DCP's metadata references (present, listed, same size; SHA-256 of its share of them) and the
  compatibility of model and optimizer with the checkpoint; all ranks agree on the outcome (one
  ``all_gather_object``) and raise the same error, naming what differs.

Limits: tensor-, pipeline- and expert-parallel size 1 (names are the model chunk's own parameter
names, as Megatron's ``get_global_unique_param_name`` gives them when PP = EP = 1, and TP shards of
one param would share a name); RNG states are
restored only when the data-parallel world size is unchanged (elsewhere there is no rank-to-rank
correspondence, and ``LoadedCheckpoint.rng_restored`` is False).
"""

from __future__ import annotations

import io
import os
import random
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron_muon.checkpointing import files
from megatron_muon.checkpointing.files import (
    INCOMPLETE_SUFFIX,
    MARKER_NAME,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
)
from megatron_muon.sharded_muon import ShardedMuon
from megatron_muon.step_wrapper import unwrap_megatron_fsdp

__all__ = [
    "INCOMPLETE_SUFFIX",
    "MARKER_NAME",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "LoadedCheckpoint",
    "SavedCheckpoint",
    "ensure_optimizer_state",
    "leaf_optimizers",
    "load_checkpoint",
    "named_optimizer_params",
    "save_checkpoint",
]

_MAX_LISTED_DIFFERENCES = 8


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


# --------------------------------------------------------------------------------------------------
# what is checkpointed: named params, leaf optimizers and their state
# --------------------------------------------------------------------------------------------------


def _as_chunks(model_chunks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(model_chunks, nn.Module):
        return [model_chunks]
    chunks = list(model_chunks)
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise ValueError("model_chunks must be an nn.Module or a non-empty list of nn.Modules")
    return chunks


def named_optimizer_params(
    model_chunks: nn.Module | Sequence[nn.Module],
) -> list[tuple[str, torch.Tensor]]:
    """(name, param) of the params an optimizer of these chunks holds, in module order.

    For a Megatron-FSDP chunk these are the DTensor main weights (``Shard(0)`` or ``Replicate`` on
    the data-parallel mesh, global shape), named as in the unwrapped module
    (``decoder.layers.0...``); the wrapper swaps other tensors into the module during forward and
    backward, so the names come from ``param_and_grad_buffer.optimizer_named_parameters``. For any
    other module: ``named_parameters()``. With several chunks, names get a ``chunk<i>.`` prefix.
    """
    chunks = _as_chunks(model_chunks)
    named: list[tuple[str, torch.Tensor]] = []
    for index, chunk in enumerate(chunks):
        prefix = f"chunk{index}." if len(chunks) > 1 else ""
        fsdp = unwrap_megatron_fsdp(chunk)
        if fsdp is not None:
            pairs = list(fsdp.param_and_grad_buffer.optimizer_named_parameters)
        else:
            pairs = list(chunk.named_parameters())
        named.extend((prefix + name, param) for name, param in pairs)
    return named


def _named_buffers(chunks: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """Persistent buffers: ``state_dict`` entries that are neither params nor extra state."""
    named: list[tuple[str, torch.Tensor]] = []
    for index, chunk in enumerate(chunks):
        prefix = f"chunk{index}." if len(chunks) > 1 else ""
        fsdp = unwrap_megatron_fsdp(chunk)
        module = fsdp.module if fsdp is not None else chunk
        params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
        for name, value in module.state_dict(keep_vars=True).items():
            if name in params or name.endswith("_extra_state") or not torch.is_tensor(value):
                continue
            if isinstance(value, nn.Parameter):
                continue
            named.append((prefix + name, value))
    return named


def leaf_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The ``torch.optim.Optimizer`` objects holding the state, in order.

    Accepts a torch optimizer, a list/tuple of them, megatron-core's ``ChainedOptimizer`` and any
    ``MegatronOptimizer`` wrapping one in ``.optimizer`` (``FP32Optimizer``, the FSDP step wrapper).
    """
    from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer

    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if isinstance(optimizer, (list, tuple)):
        return [leaf for child in optimizer for leaf in leaf_optimizers(child)]
    if isinstance(optimizer, ChainedOptimizer):
        return [leaf for child in optimizer.chained_optimizers for leaf in leaf_optimizers(child)]
    if isinstance(optimizer, MegatronOptimizer):
        return leaf_optimizers(optimizer.optimizer)
    raise TypeError(
        f"cannot find the torch optimizers inside {type(optimizer).__name__}: pass a "
        "torch.optim.Optimizer, a list of them, or a megatron-core (Chained)MegatronOptimizer"
    )


def _emerging_optimizer_classes() -> tuple[type, type]:
    from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer
    from emerging_optimizers.scalar_optimizers import Lion

    return OrthogonalizedOptimizer, Lion


def _expected_state_keys(optimizer: torch.optim.Optimizer, group: dict) -> tuple[str, ...]:
    """State keys every param of ``group`` holds once the optimizer has state for it."""
    orthogonalized, lion = _emerging_optimizer_classes()
    if isinstance(optimizer, orthogonalized):  # Muon, TensorParallelMuon, ShardedMuon
        return ("momentum_buffer",)
    if isinstance(optimizer, lion):
        return ("exp_avg",)
    if isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        keys = ("step", "exp_avg", "exp_avg_sq")
        return (*keys, "max_exp_avg_sq") if group.get("amsgrad", False) else keys
    raise TypeError(
        f"checkpointing does not know how {type(optimizer).__name__} creates its state without a "
        "step; supported: Muon (emerging_optimizers OrthogonalizedOptimizer, ShardedMuon), "
        "emerging_optimizers Lion, torch.optim.Adam, torch.optim.AdamW"
    )


@torch.no_grad()
def _create_state(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> None:
    """The state ``optimizer`` creates lazily on its first step, created now (zeros, step 0)."""
    if isinstance(optimizer, _emerging_optimizer_classes()):
        # emerging_optimizers' own lazy init, for params without a grad too.
        optimizer._init_group(group, skip_non_grad_params=False)
        return
    # torch.optim.Adam._init_group, without taking a step (REFERENCE.md section 5).
    state = optimizer.state[param]
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    if group["capturable"] or group["fused"]:
        state["step"] = torch.zeros((), dtype=dtype, device=param.device)
    else:
        state["step"] = torch.tensor(0.0, dtype=dtype, device="cpu")
    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor for a collective over ``group`` must live (NCCL: the current GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _param_process_groups(param: torch.Tensor) -> list[dist.ProcessGroup]:
    """The groups of the param's mesh dims (data-parallel replicas, shards); none if plain."""
    if not isinstance(param, DTensor):
        return []
    mesh = param.device_mesh
    return [mesh.get_group(dim) for dim in range(mesh.ndim)]


@torch.no_grad()
def ensure_optimizer_state(optimizer: Any) -> None:
    """Creates the missing state of every param of every leaf optimizer, without stepping.

    Collective: every rank of each param's data-parallel mesh must call it. Adam's per-param
    ``step`` (a plain 0-d tensor, replicated) is then set to its maximum over the param's mesh: the
    ranks holding rows of the param all stepped it, while a rank with 0 rows (``grad is None``)
    never did. Momentum and moments are DTensors like their param (global shape, placements).
    """
    stepped: dict[tuple[int, ...], list[torch.Tensor]] = {}
    mesh_groups: dict[tuple[int, ...], list[dist.ProcessGroup]] = {}
    for leaf in leaf_optimizers(optimizer):
        if isinstance(leaf, ShardedMuon):
            # Offloaded momentum has its storage freed between steps: DCP would read freed memory.
            leaf.bring_momentum_back()
        for group in leaf.param_groups:
            keys = _expected_state_keys(leaf, group)
            for param in group["params"]:
                state = leaf.state[param]
                if not state:
                    _create_state(leaf, group, param)
                missing = [k for k in keys if k not in state]
                if missing:
                    raise RuntimeError(
                        f"{type(leaf).__name__} holds partial state for a param of shape "
                        f"{tuple(param.shape)}: {sorted(state)} lacks {missing}"
                    )
                groups = _param_process_groups(param)
                if "step" in state and groups:
                    key = tuple(id(g) for g in groups)
                    mesh_groups[key] = groups
                    stepped.setdefault(key, []).append(state["step"])
    # One all_reduce per mesh dim of each distinct mesh, in first-appearance order (the same on
    # every rank of the mesh: Megatron-FSDP gives every rank the same params in the same order).
    for key, steps in stepped.items():
        device = _collective_device(mesh_groups[key][0])
        values = torch.stack([s.detach().to(device, torch.float64) for s in steps])
        for group in mesh_groups[key]:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        for step, value in zip(steps, values.tolist(), strict=True):
            step.fill_(value)


# --------------------------------------------------------------------------------------------------
# the state dict DCP sees, and the manifest (completion marker)
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Inventory:
    """Everything checkpointed, by name, in the same order on every rank."""

    params: list[tuple[str, torch.Tensor]]
    buffers: list[tuple[str, torch.Tensor]]
    leaves: list[torch.optim.Optimizer]
    param_owner: dict[str, tuple[torch.optim.Optimizer, dict]]  # name -> (leaf, group)
    group_names: list[list[list[str]]]  # per leaf, per group: param names


def _inventory(model_chunks: Any, optimizer: Any) -> _Inventory:
    chunks = _as_chunks(model_chunks)
    params = named_optimizer_params(chunks)
    name_of = {id(p): n for n, p in params}
    leaves = leaf_optimizers(optimizer)
    owner: dict[str, tuple[torch.optim.Optimizer, dict]] = {}
    group_names: list[list[list[str]]] = []
    for index, leaf in enumerate(leaves):
        per_group = []
        for group_index, group in enumerate(leaf.param_groups):
            names = []
            for param in group["params"]:
                name = name_of.get(id(param))
                if name is None:
                    raise ValueError(
                        f"optimizer {index} ({type(leaf).__name__}) group {group_index} holds a "
                        f"param of shape {tuple(param.shape)} that is not a param of model_chunks "
                        "(build the optimizer from the wrapped model's parameters)"
                    )
                if name in owner:
                    raise ValueError(f"param {name} is held by two optimizers or groups")
                owner[name] = (leaf, group)
                names.append(name)
            per_group.append(names)
        group_names.append(per_group)
    return _Inventory(params, _named_buffers(chunks), leaves, owner, group_names)


def _state_dict(inventory: _Inventory) -> dict[str, Any]:
    """The nested dict DCP saves, or loads in place: the live params, buffers and state tensors."""
    model = dict(inventory.params)
    model.update(dict(inventory.buffers))
    state = {
        name: dict(inventory.param_owner[name][0].state[param])
        for name, param in inventory.params
        if name in inventory.param_owner
    }
    return {"model": model, "optimizer": {"state": state}}


def _describe(tensor: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def _manifest_body(inventory: _Inventory, iteration: int, has_scheduler: bool) -> dict[str, Any]:
    params = {}
    for name, param in inventory.params:
        entry = _describe(param)
        if name in inventory.param_owner:
            leaf, group = inventory.param_owner[name]
            entry["optimizer"] = type(leaf).__name__
            entry["state"] = list(_expected_state_keys(leaf, group))
        params[name] = entry
    return {
        "iteration": iteration,
        "world_size": dist.get_world_size(),
        "params": params,
        "buffers": {name: _describe(buffer) for name, buffer in inventory.buffers},
        "optimizers": [
            {"class": type(leaf).__name__, "groups": names}
            for leaf, names in zip(inventory.leaves, inventory.group_names, strict=True)
        ],
        "has_scheduler": has_scheduler,
    }


def _differences(saved: dict[str, Any], current: dict[str, Any], scheduler: Any) -> list[str]:
    """What differs between a checkpoint's manifest and this run's model/optimizer, in words."""
    differences: list[str] = []
    saved_params, current_params = saved["params"], current["params"]
    only_saved = [n for n in saved_params if n not in current_params]
    only_current = [n for n in current_params if n not in saved_params]
    if only_saved:
        differences.append(f"params in the checkpoint but not in this model: {only_saved[:8]}")
    if only_current:
        differences.append(f"params in this model but not in the checkpoint: {only_current[:8]}")
    for name, mine in current_params.items():
        theirs = saved_params.get(name)
        if theirs is None:
            continue
        if theirs["shape"] != mine["shape"]:
            differences.append(
                f"param {name}: shape {tuple(theirs['shape'])} in the checkpoint, "
                f"{tuple(mine['shape'])} in this model"
            )
        elif theirs["dtype"] != mine["dtype"]:
            differences.append(
                f"param {name}: dtype {theirs['dtype']} in the checkpoint, {mine['dtype']} here"
            )
        if theirs.get("state") != mine.get("state"):
            differences.append(
                f"param {name}: the checkpoint holds {theirs.get('optimizer')} state "
                f"{theirs.get('state')}, this run's optimizer for it is {mine.get('optimizer')} "
                f"with state {mine.get('state')}"
            )
    for name, mine in current["buffers"].items():
        theirs = saved["buffers"].get(name)
        if theirs is None:
            differences.append(f"buffer {name} is not in the checkpoint")
        elif theirs != mine:
            differences.append(f"buffer {name}: {theirs} in the checkpoint, {mine} here")
    if not differences:
        differences.extend(_group_differences(saved["optimizers"], current["optimizers"]))
    if scheduler is not None and not saved.get("has_scheduler", False):
        differences.append("a scheduler was passed but the checkpoint holds no scheduler state")
    return differences


def _group_differences(saved: list[dict], current: list[dict]) -> list[str]:
    """Differences in how params are split into optimizers and groups (order inside a group is
    free: it follows Megatron-FSDP's buckets, which depend on the sharding strategy)."""

    def describe(optimizers: list[dict]) -> list[tuple[str, int]]:
        return [(o["class"], len(o["groups"])) for o in optimizers]

    if describe(saved) != describe(current):
        return [
            f"optimizers differ: the checkpoint has {describe(saved)} (class, number of groups), "
            f"this run has {describe(current)}"
        ]
    differences = []
    for index, (theirs, mine) in enumerate(zip(saved, current, strict=True)):
        for group, (their_names, my_names) in enumerate(
            zip(theirs["groups"], mine["groups"], strict=True)
        ):
            only_saved = sorted(set(their_names) - set(my_names))
            only_mine = sorted(set(my_names) - set(their_names))
            if only_saved or only_mine:
                differences.append(
                    f"optimizer {index} ({mine['class']}) group {group}: params only in the "
                    f"checkpoint's group {only_saved[:8]}, only in this run's {only_mine[:8]}"
                )
    return differences


# --------------------------------------------------------------------------------------------------
# small objects (scheduler, param groups, RNG, extra), pickled to bytes so DCP stores them whole
# --------------------------------------------------------------------------------------------------


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _param_groups_by_name(inventory: _Inventory) -> list[list[dict[str, Any]]]:
    return [
        [
            {**{k: v for k, v in group.items() if k != "params"}, "params": names}
            for group, names in zip(leaf.param_groups, leaf_names, strict=True)
        ]
        for leaf, leaf_names in zip(inventory.leaves, inventory.group_names, strict=True)
    ]


def _restore_param_groups(inventory: _Inventory, saved: list[list[dict[str, Any]]]) -> None:
    """Hyperparameters (lr, momentum, betas, weight decay, ...) back into the live groups."""
    for leaf, saved_groups in zip(inventory.leaves, saved, strict=True):
        for group, saved_group in zip(leaf.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved_group.items() if k != "params"})


def _rng_tracker() -> Any:
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except ImportError:  # pragma: no cover
        return None
    tracker = get_cuda_rng_tracker()
    return tracker if tracker.is_initialized() else None


def _capture_rng() -> dict[str, Any]:
    """This rank's RNG states: Python, NumPy, torch CPU, CUDA (if in use), Megatron's tracker."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = _rng_tracker()
    if tracker is not None:
        state["megatron_tracker"] = tracker.get_states()
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = _rng_tracker()
    if "megatron_tracker" in state and tracker is not None:
        tracker.set_states(state["megatron_tracker"])


# --------------------------------------------------------------------------------------------------
# ranks in agreement, weights install
# --------------------------------------------------------------------------------------------------


def _agree_on_ranks(error: BaseException | None, path: str, names: list[str]) -> None:
    """Every rank raises the same error unless no rank failed, all passed the same ``path`` and
    hold the same params in the same order (else DCP's collectives would fall out of step)."""
    gathered = files.agree(error, (path, names))
    paths = [p for p, _ in gathered]
    if len(set(paths)) > 1:
        raise CheckpointError(
            "ranks passed different checkpoint paths (every rank must pass the same directory, "
            f"on a shared file system): {dict(enumerate(paths))}"
        )
    mine = gathered[0][1]
    for rank, (_, theirs) in enumerate(gathered):
        if theirs != mine:
            position = next(
                (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                min(len(mine), len(theirs)),
            )
            on_0 = mine[position] if position < len(mine) else "nothing"
            on_r = theirs[position] if position < len(theirs) else "nothing"
            raise CheckpointError(
                f"ranks hold different params: param {position} is {on_0} on rank 0 and {on_r} "
                f"on rank {rank} ({len(mine)} and {len(theirs)} params); every rank must pass "
                "the same model and optimizer"
            )


def _install_model_weights(chunks: list[nn.Module]) -> None:
    """Makes the forward read the (loaded) main weights. Collective over each chunk's DP group.

    ``install_optimized_model_weights`` copies them into the compute weights' own shard; gathered
    copies that Megatron-FSDP keeps between forwards (every bucket under ``optim``/``optim_grads``,
    where the compute weights are whole; the non-FSDP-unit buckets under ``optim_grads_params``)
    are marked stale by ``synchronize_param_gather`` and gathered anew by ``start_param_sync`` or
    the next forward, as after an optimizer step. Measured without this: an eval after loading
    into a trained model gave the trained model's loss (5.630 instead of the checkpoint's 5.558).
    """
    for chunk in chunks:
        fsdp = unwrap_megatron_fsdp(chunk)
        if fsdp is not None:
            fsdp.install_optimized_model_weights()
            fsdp.synchronize_param_gather()
            fsdp.start_param_sync()


def _local_row_chunk(param: torch.Tensor) -> ChunkStorageMetadata | None:
    """This rank's chunk of a Megatron-FSDP param, from local facts only; None if unknown here.

    Rows of a ``Shard(0)`` param start at ``megatron_fsdp_slice.start // row_numel`` (the slice of
    the flattened param this rank holds; the only reliable offset under HSDP outer sharding, where
    rank order is not row order); a ``Replicate`` param's chunk is the whole tensor.
    """
    local = param.to_local()
    zeros = (0,) * local.ndim
    placements = param.placements
    if all(isinstance(p, Replicate) for p in placements):
        return ChunkStorageMetadata(offsets=torch.Size(zeros), sizes=local.shape)
    if not all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in placements
    ):
        return None
    fsdp_slice = getattr(param, "megatron_fsdp_slice", None)
    row_numel = max(1, local.shape[1:].numel())
    if fsdp_slice is None or fsdp_slice.stop - fsdp_slice.start != local.numel():
        return None
    if local.numel() == 0:
        return ChunkStorageMetadata(offsets=torch.Size(zeros), sizes=local.shape)
    if fsdp_slice.start % row_numel:
        return None
    offsets = (fsdp_slice.start // row_numel, *zeros[1:])
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=local.shape)


def _attach_chunk(dtensor: DTensor, chunk: ChunkStorageMetadata) -> None:
    """Makes DCP plan ``dtensor`` as ``chunk`` (the true uneven rows), as megatron_fsdp's
    ``update_uneven_dtensor_chunk_metadata`` does, but with a chunk known without a collective.
    An empty shard writes nothing (and reads nothing: it overlaps no saved chunk)."""

    def write_items(fqn: str, tensor: DTensor) -> list[WriteItem]:
        local = tensor.to_local()
        if local.numel() == 0:
            return []
        return [
            WriteItem(
                type=WriteItemType.SHARD,
                index=MetadataIndex(fqn, chunk.offsets),
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(local),
                    size=tensor.size(),
                ),
            )
        ]

    # DTensor's checkpoint hooks (``__create_chunk_list__`` / ``__create_write_items__``) defer to
    # these attributes of its ``_local_tensor`` (DTensor's documented extension point for DCP, the
    # one megatron_fsdp uses). ``to_local()`` of an ``nn.Parameter`` DTensor returns a fresh view,
    # so the attributes must go on ``_local_tensor`` itself.
    local = dtensor._local_tensor
    local.__create_chunk_list__ = lambda: [chunk]
    local.__create_write_items__ = write_items


@torch.no_grad()
def _attach_row_chunks(inventory: _Inventory, state_dict: dict[str, Any]) -> None:
    """Gives every DTensor in ``state_dict`` its true uneven-row chunk metadata.

    A param and its state tensors (same local shape and placements) share one chunk. Chunks come
    from ``megatron_fsdp_slice`` without communication; params where some rank cannot tell (one
    ``all_reduce`` of flags decides, so every rank agrees) go through megatron_fsdp's
    ``gather_and_compute_chunk_metadata`` (one ``all_gather_object`` each, in name order).
    """
    from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata

    names = [name for name, param in inventory.params if isinstance(param, DTensor)]
    params = dict(inventory.params)
    chunks = {name: _local_row_chunk(params[name]) for name in names}
    known = torch.tensor(
        [chunks[n] is not None for n in names], dtype=torch.int32, device=_collective_device(None)
    )
    if dist.get_world_size() > 1:
        dist.all_reduce(known, op=dist.ReduceOp.MIN)
    state = state_dict["optimizer"]["state"]
    for name, is_known in zip(names, known.tolist(), strict=True):
        param = params[name]
        chunk = chunks[name] if is_known else gather_and_compute_chunk_metadata(param)
        _attach_chunk(param, chunk)
        for value in state.get(name, {}).values():
            if not isinstance(value, DTensor):
                continue
            same = value.to_local().shape == param.to_local().shape
            if not (same and value.placements == param.placements):
                raise RuntimeError(
                    f"optimizer state of {name} is laid out unlike the param: local "
                    f"{tuple(value.to_local().shape)} {value.placements} vs "
                    f"{tuple(param.to_local().shape)} {param.placements}"
                )
            _attach_chunk(value, chunk)


# --------------------------------------------------------------------------------------------------
# the two public functions
# --------------------------------------------------------------------------------------------------


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
    inventory: _Inventory | None = None
    common: dict[str, Any] = {}
    try:
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")
        inventory = _inventory(_as_chunks(model_chunks), optimizer)
        if rank == 0:
            common = _rank0_common(inventory, iteration, extra, scheduler)
    except Exception as caught:  # noqa: BLE001 - every rank must learn of it before a collective
        error = caught
    _agree_on_ranks(error, path, _names(inventory))
    assert inventory is not None

    error, token = None, None
    if rank == 0:
        try:
            token = files.create_directory(path, overwrite)
        except OSError as caught:
            error = caught
    token = files.agree(error, token)[0]
    error = None
    try:
        files.check_shared_directory(path, token)
    except CheckpointError as caught:
        error = caught
    files.agree(error)

    ensure_optimizer_state(inventory.leaves)
    common[f"rng.rank{rank}"] = _to_bytes(_capture_rng())
    state_dict = _state_dict(inventory)
    state_dict["common"] = common
    _attach_row_chunks(inventory, state_dict)
    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(path + INCOMPLETE_SUFFIX))
    files.publish(path, _manifest_body(inventory, int(iteration), scheduler is not None), overwrite)
    num_bytes = 0
    if rank == 0:
        num_bytes = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return SavedCheckpoint(path=path, num_bytes=num_bytes, seconds=time.perf_counter() - start)


def _names(inventory: _Inventory | None) -> list[str]:
    return [] if inventory is None else [name for name, _ in inventory.params]


def _rank0_common(
    inventory: _Inventory, iteration: int, extra: Any, scheduler: Any
) -> dict[str, bytes]:
    """What rank 0 alone writes (identical on every rank; DCP would keep an arbitrary rank's
    copy), pickled now, before any collective: an unpicklable ``extra`` fails here."""
    return {
        "iteration": _to_bytes(int(iteration)),
        "extra": _to_bytes(extra),
        "scheduler": _to_bytes(None if scheduler is None else scheduler.state_dict()),
        "param_groups": _to_bytes(_param_groups_by_name(inventory)),
    }


def load_checkpoint(
    path: str | os.PathLike[str],
    model_chunks: nn.Module | Sequence[nn.Module],
    optimizer: Any,
    scheduler: Any = None,
    *,
    load_rng: bool = True,
) -> LoadedCheckpoint:
    """Loads a checkpoint of ``save_checkpoint`` into the live model and optimizer, in place.

    Collective over the default process group. Works at any data-parallel size and sharding
    strategy: each rank reads exactly the rows it holds now. Checks first, on every rank, that the
    checkpoint is complete and matches the model (param names, shapes, dtypes) and the optimizer
    (which state each param holds, param groups); on any difference every rank raises the same
    ``CheckpointError`` and nothing is changed. Afterwards the main weights are installed into
    Megatron-FSDP's compute weights (as after an optimizer step), param-group hyperparameters and
    the scheduler are restored, and, when the world size is unchanged and ``load_rng``, the RNGs.

    The checks cover every failure known before reading (missing, incomplete, mismatched); an I/O
    error during DCP's read itself (disk failure) raises on all ranks but may leave tensors partly
    overwritten: load again, or restart.

    Returns:
        The saved iteration and ``extra``, the world size at save time, whether RNGs were restored.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist (what an interrupted save or overwrite
            left next to it is named).
        IncompleteCheckpointError: no or a damaged completion marker, or a file missing,
            truncated or altered (SHA-256).
        CheckpointMismatchError: saved from a different model or optimizer (the message names it).
        CheckpointError: the ranks passed different paths or hold different params.
    """
    start = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    chunks = _as_chunks(model_chunks)
    error: BaseException | None = None
    inventory: _Inventory | None = None
    manifest: dict[str, Any] = {}
    try:
        inventory = _inventory(chunks, optimizer)
        manifest = files.read_marker(path)
        current = _manifest_body(inventory, 0, scheduler is not None)
        differences = _differences(manifest, current, scheduler)
        if differences:
            listed = differences[:_MAX_LISTED_DIFFERENCES]
            more = len(differences) - len(listed)
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match this model/optimizer:\n  "
                + "\n  ".join(listed)
                + (f"\n  ... and {more} more" if more > 0 else "")
            )
        files.verify(path, manifest)
    except Exception as caught:  # noqa: BLE001 - every rank must learn of it before a collective
        error = caught
    _agree_on_ranks(error, path, _names(inventory))
    assert inventory is not None

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
    state_dict = _state_dict(inventory)
    state_dict["common"] = common
    _attach_row_chunks(inventory, state_dict)
    dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path))

    loaded = {key: _from_bytes(value) for key, value in state_dict["common"].items()}
    _restore_param_groups(inventory, loaded["param_groups"])
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    if restore_rng:
        _restore_rng(loaded[f"rng.rank{rank}"])
    _install_model_weights(chunks)
    return LoadedCheckpoint(
        iteration=loaded["iteration"],
        extra=loaded["extra"],
        saved_world_size=manifest["world_size"],
        rng_restored=restore_rng,
        seconds=time.perf_counter() - start,
    )

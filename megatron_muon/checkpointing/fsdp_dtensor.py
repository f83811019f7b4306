"""What a checkpoint holds, in Megatron's ``fsdp_dtensor`` layout: everything keyed by param name.

Every tensor that belongs to a parameter is stored as a DTensor with the parameter's **global**
shape and placements (``Shard(0)`` by whole rows over the data-parallel mesh, or ``Replicate``
under ``no_shard``):

- ``model.<name>``: the main (optimizer) weights Megatron-FSDP hands the optimizer; persistent
  buffers of the module as plain tensors;
- ``optimizer.state.<name>.<key>``: ``momentum_buffer`` (Muon), ``exp_avg`` / ``exp_avg_sq`` /
  ``step`` (Adam, AdamW);
- ``common.param_groups`` (hyperparameters, params by name), ``common.scheduler``,
  ``common.iteration``, ``common.extra`` (written once, by rank 0) and ``common.rng.rank<r>`` (each
  rank's RNG states), pickled whole (``to_bytes``) and read back restricted (``from_bytes``:
  ``safe_unpickle``).

Names are the model chunk's own parameter names, as Megatron's ``get_global_unique_param_name``
gives them when pipeline- and expert-parallel sizes are 1.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_muon.checkpointing.optimizer_state import leaf_optimizers
from megatron_muon.checkpointing.safe_unpickle import load_pickled
from megatron_muon.common.megatron_fsdp_compat import unwrap_megatron_fsdp

__all__ = [
    "Inventory",
    "as_chunks",
    "dcp_state_dict",
    "from_bytes",
    "inventory",
    "named_optimizer_params",
    "param_groups_by_name",
    "restore_param_groups",
    "to_bytes",
]


def as_chunks(model_chunks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """``model_chunks`` as a non-empty list of modules (a single module becomes a list of one)."""
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
    chunks = as_chunks(model_chunks)
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


@dataclass(slots=True)
class Inventory:
    """Everything checkpointed, by name, in the same order on every rank."""

    params: list[tuple[str, torch.Tensor]]
    buffers: list[tuple[str, torch.Tensor]]
    leaves: list[torch.optim.Optimizer]
    param_owner: dict[str, tuple[torch.optim.Optimizer, dict]]  # name -> (leaf, group)
    group_names: list[list[list[str]]]  # per leaf, per group: param names

    def names(self) -> list[str]:
        """The params' names, in order."""
        return [name for name, _ in self.params]


def inventory(model_chunks: Any, optimizer: Any) -> Inventory:
    """The named params and buffers of ``model_chunks`` and which leaf optimizer and group holds
    each param.

    Raises:
        ValueError: a param the optimizer holds is not one of ``model_chunks``', or two
            optimizers or groups hold one param.
    """
    chunks = as_chunks(model_chunks)
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
    return Inventory(params, _named_buffers(chunks), leaves, owner, group_names)


def dcp_state_dict(inventory: Inventory) -> dict[str, Any]:
    """The nested dict DCP saves, or loads in place: the live params, buffers and state tensors."""
    model = dict(inventory.params)
    model.update(dict(inventory.buffers))
    state = {
        name: dict(inventory.param_owner[name][0].state[param])
        for name, param in inventory.params
        if name in inventory.param_owner
    }
    return {"model": model, "optimizer": {"state": state}}


# --------------------------------------------------------------------------------------------------
# small objects (scheduler, param groups, RNG, extra), pickled to bytes so DCP stores them whole
# --------------------------------------------------------------------------------------------------


def to_bytes(obj: Any) -> bytes:
    """``obj`` pickled by ``torch.save``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes, where: str, *, trust_pickles: bool = False) -> Any:
    """What ``to_bytes`` pickled, read restricted (``safe_unpickle.load_pickled``: ``where``
    names it in a refusal) unless ``trust_pickles``."""
    return load_pickled(data, where, trust_pickles=trust_pickles)


def param_groups_by_name(inventory: Inventory) -> list[list[dict[str, Any]]]:
    """Per leaf optimizer, per group: its hyperparameters and its params' names."""
    return [
        [
            {**{k: v for k, v in group.items() if k != "params"}, "params": names}
            for group, names in zip(leaf.param_groups, leaf_names, strict=True)
        ]
        for leaf, leaf_names in zip(inventory.leaves, inventory.group_names, strict=True)
    ]


def restore_param_groups(inventory: Inventory, saved: list[list[dict[str, Any]]]) -> None:
    """Hyperparameters (lr, momentum, betas, weight decay, ...) back into the live groups."""
    for leaf, saved_groups in zip(inventory.leaves, saved, strict=True):
        for group, saved_group in zip(leaf.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved_group.items() if k != "params"})

"""megatron-core's ``torch_dist`` checkpoints of a run without Megatron-FSDP, read and written in
model space (``convert.names`` lists the keys).

Read: Megatron's DDP with the distributed optimizer saved in a model-space format
(``--dist-ckpt-optim-fully-reshardable``: each state tensor a global tensor under its param's key).
The per-bucket formats (``dp_reshardable``, the default without that flag;
``dp_zero_gather_scatter``) hold flat buffer shards whose meaning depends on the saving run's
buckets: refused by name. megatron-core's own Muon (``--optimizer muon
--use-distributed-optimizer``: ``LayerWiseDistributedOptimizer``) saves model space whatever the
flag (``convert.layer_wise``). The common state (``common_state/shard_0_1``: ``args``,
``iteration``, the scheduler, the param groups with Adam's ``step``) is read restricted.

Written: the same layout, loadable by Megatron-LM's ``--ckpt-format torch_dist
--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable`` at any TP and DP (its load
reshards global tensors), or for Muon by its ``--optimizer muon --use-distributed-optimizer``
(LayerWise); params go to groups by megatron-core's default weight-decay rule. Each
layer's linear modules get the extra state the local spec saves (``None``); Transformer Engine's
(its FP8 metadata) is written empty too: not measured with Transformer Engine.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch

from megatron_muon.convert import layer_wise, names
from megatron_muon.convert.dcp_files import DcpFiles
from megatron_muon.convert.model_space import (
    ADAM_STATE,
    ConversionRefused,
    ModelSpace,
    check_source_args,
    group_by_weight_decay,
    refuse_unless,
)

__all__ = ["COMMON_KEY", "read_torch_dist", "torch_dist_values"]

COMMON_KEY = "common_state/shard_0_1"
_STATE_PREFIX = "optimizer.state."
_MODEL_SPACE_FORMAT = "fully_reshardable"
_GROUP_KEYS_NOT_META = ("params", "step")


def _common(files: DcpFiles) -> dict[str, Any]:
    refuse_unless(
        COMMON_KEY in files.object_keys,
        f"{files.directory}: no {COMMON_KEY}: not a torch_dist checkpoint of megatron-core 0.19",
    )
    stored = files.objects([COMMON_KEY])[COMMON_KEY]
    return dict(stored[0] if isinstance(stored, list) else stored)


def _param_groups(common: dict[str, Any], source: str) -> list[dict[str, Any]]:
    optimizer = common.get("optimizer")
    if not isinstance(optimizer, dict):
        raise ConversionRefused(f"{source}: no optimizer state (saved with --no-save-optim?)")
    sharding = optimizer.get("param_state_sharding_type")
    refuse_unless(
        sharding is not None,
        f"{source}: no distributed-optimizer state (a run without --use-distributed-optimizer): "
        "only the distributed optimizer's model-space format is mapped",
    )
    refuse_unless(
        sharding == _MODEL_SPACE_FORMAT,
        f"{source}: distributed-optimizer state of type {sharding!r}: its flat per-bucket "
        "shards have no model-space meaning; save with --dist-ckpt-optim-fully-reshardable",
    )
    metadata = common.get("content_metadata") or {}
    refuse_unless(
        not metadata.get("singleton_local_shards", False),
        f"{source}: singleton_local_shards checkpoints (separate _w/_v keys) are not mapped",
    )
    return list(optimizer["optimizer"]["param_groups"])


def _layer(tensor: torch.Tensor, layer: int | None) -> torch.Tensor:
    """One layer's copy of a stacked tensor (``layer`` None: the tensor is no layer's)."""
    return (tensor if layer is None else tensor[layer]).clone()


def _empty_space(common: dict[str, Any], args: argparse.Namespace) -> ModelSpace:
    return ModelSpace(
        params={},
        state={},
        steps={},
        groups={},
        scheduler=dict(common["opt_param_scheduler"]),
        args=args,
        iteration=int(common["iteration"]),
        flops=float(common.get("num_floating_point_operations_so_far", 0)),
        checkpoint_version=float(common.get("checkpoint_version", 3.0)),
    )


def _unstacked(key: str, impl: str, tensor: torch.Tensor) -> list[tuple[str, int | None]]:
    """[(model-space name, layer)] of one torch_dist key (its layers, or itself)."""
    layers = range(tensor.shape[0]) if names.is_stacked(key) else [None]
    return [(names.unstacked_name(key, layer, impl), layer) for layer in layers]


def read_torch_dist(directory: str) -> ModelSpace:
    """A ``torch_dist`` checkpoint (one ``iter_XXXXXXX`` directory) in model space.

    Raises:
        ConversionRefused: a layout or state without an fsdp_dtensor counterpart (named).
    """
    files = DcpFiles(directory)
    common = _common(files)
    args = common["args"]
    check_source_args(args, directory)
    if getattr(args, "optimizer", None) == "muon":
        return _read_layer_wise(files, common, directory)
    groups = group_by_weight_decay(_param_groups(common, directory), directory)
    impl = str(getattr(args, "transformer_impl", "transformer_engine"))
    model_keys = [k for k in files.tensor_keys if not k.startswith("optimizer.")]
    tensors = files.tensors(list(files.tensor_keys))
    space = _empty_space(common, args)
    for key in model_keys:
        main = tensors.get(f"{_STATE_PREFIX}param.{key}", tensors[key])
        for name, layer in _unstacked(key, impl, main):
            space.params[name] = _layer(main, layer)
            space.state[name] = {
                kind: _layer(tensors[f"{_STATE_PREFIX}{kind}.{key}"], layer) for kind in ADAM_STATE
            }
            group = groups[names.no_weight_decay(name, space.params[name].ndim)]
            space.steps[name] = float(group["step"])
            space.groups[name] = {k: v for k, v in group.items() if k not in _GROUP_KEYS_NOT_META}
    space.notes.append("weights: the fp32 main params of the distributed optimizer")
    return space


def _read_layer_wise(files: DcpFiles, common: dict[str, Any], directory: str) -> ModelSpace:
    """megatron-core's Muon under ``LayerWiseDistributedOptimizer`` in model space
    (``convert.layer_wise``): fp32 weights, each matrix's ``momentum_buffer``, AdamW's state.

    Raises:
        ConversionRefused: Muon without LayerWise, or state of another kind (named).
    """
    args = common["args"]
    refuse_unless(
        bool(getattr(args, "use_layer_wise_distributed_optimizer", False))
        and layer_wise.is_layer_wise(common),
        f"{directory}: --optimizer muon without --use-distributed-optimizer "
        "(LayerWiseDistributedOptimizer): only LayerWise's state is mapped",
    )
    keys = set(files.tensor_keys)
    children = layer_wise.layer_wise_children(common, keys, directory)
    impl = str(getattr(args, "transformer_impl", "transformer_engine"))
    tensors = files.tensors(list(keys))
    space = _empty_space(common, args)
    for key in [k for k in keys if not k.startswith(("chained_", "optimizer."))]:
        child, state_keys = layer_wise.child_state(key, children, keys)
        for name, layer in _unstacked(key, impl, tensors[key]):
            space.params[name] = _layer(tensors[key], layer)
            space.state[name] = {k: _layer(tensors[v], layer) for k, v in state_keys.items()}
            rule = names.no_weight_decay(name, space.params[name].ndim)
            refuse_unless(rule in child.groups, f"{name}: no LayerWise group of its weight decay")
            space.groups[name] = dict(child.groups[rule])
            if child.step is not None:
                space.steps[name] = child.step
    space.notes.append("weights: the fp32 params (LayerWise keeps no separate main params)")
    return space


# --------------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------------


def _stacked(space: ModelSpace) -> dict[str, list[tuple[int | None, str]]]:
    """torch_dist key -> [(layer, model-space name)] in layer order."""
    keys: dict[str, list[tuple[int | None, str]]] = {}
    for name in space.params:
        key, layer = names.stacked_name(name, space.transformer_impl)
        keys.setdefault(key, []).append((layer, name))
    for key, members in keys.items():
        layers = sorted(layer for layer, _ in members if layer is not None)
        refuse_unless(
            layers == list(range(len(members))) or layers == [],
            f"{key}: layers {layers}: not every decoder layer holds it (heterogeneous layers)",
        )
        members.sort(key=lambda item: -1 if item[0] is None else item[0])
    return keys


def _join(tensors: list[torch.Tensor], stacked: bool) -> torch.Tensor:
    return torch.stack(tensors) if stacked else tensors[0]


def _torch_dist_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` as a Megatron-DDP run saves them (Muon: as ``validate_args`` leaves
    ``--use-distributed-optimizer``: LayerWise on, the distributed optimizer off)."""
    converted = copy.copy(args)
    converted.ckpt_format = "torch_dist"
    converted.use_megatron_fsdp = False
    muon = getattr(args, "optimizer", None) == "muon"
    converted.use_distributed_optimizer = not muon
    converted.use_layer_wise_distributed_optimizer = muon
    converted.dist_ckpt_optim_fully_reshardable = not muon
    return converted


def _groups_with_steps(space: ModelSpace) -> list[dict[str, Any]]:
    """One param group per distinct group meta, each with its params' one ``step``.

    Raises:
        ConversionRefused: params of one group with different steps (torch_dist keeps one).
    """
    groups: list[tuple[dict[str, Any], float, str]] = []
    for name, meta in space.groups.items():
        for known, step, first in groups:
            if known == meta:
                refuse_unless(
                    step == space.steps[name],
                    f"{name} has step {space.steps[name]}, {first} of its group {step}: "
                    "torch_dist keeps one step per param group",
                )
                break
        else:
            groups.append((meta, space.steps[name], name))
    return [{**meta, "step": step} for meta, step, _ in groups]


def _distributed_adam_values(
    space: ModelSpace, stacked_keys: dict[str, list[tuple[int | None, str]]]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The distributed optimizer's state tensors (Adam's moments and main params), the common
    state's ``optimizer`` and the content metadata, in its model-space format."""
    values: dict[str, Any] = {}
    for key, members in stacked_keys.items():
        stacked = members[0][0] is not None
        values[f"{_STATE_PREFIX}param.{key}"] = _join(
            [space.params[n] for _, n in members], stacked
        )
        for kind in ADAM_STATE:
            values[f"{_STATE_PREFIX}{kind}.{key}"] = _join(
                [space.state[n][kind] for _, n in members], stacked
            )
    optimizer = {
        "optimizer": {"param_groups": _groups_with_steps(space)},
        "param_state_sharding_type": _MODEL_SPACE_FORMAT,
    }
    metadata = {
        "distrib_optim_sharding_type": _MODEL_SPACE_FORMAT,
        "distrib_optim_fully_reshardable_mem_efficient": False,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }
    return values, optimizer, metadata


def torch_dist_values(space: ModelSpace) -> dict[str, Any]:
    """The flat ``{key: value}`` of the torch_dist checkpoint of ``space`` (Adam: the distributed
    optimizer's model-space format; Muon: ``LayerWiseDistributedOptimizer``'s)."""
    values: dict[str, Any] = {}
    num_layers = int(space.args.num_layers)
    stacked_keys = _stacked(space)
    optimizer: dict[Any, Any]
    if space.optimizer == "muon":
        state, optimizer = layer_wise.layer_wise_optimizer_values(space, stacked_keys, _join)
        metadata: dict[str, Any] = dict(layer_wise.CONTENT_METADATA)
    else:
        state, optimizer, metadata = _distributed_adam_values(space, stacked_keys)
    values.update(state)
    for key, members in stacked_keys.items():
        stacked = members[0][0] is not None
        values[key] = _join([space.params[n] for _, n in members], stacked)
        # Each layer's linear modules save an extra state (None without Transformer Engine); a
        # ShardedObject is stored as a one-item list, as megatron-core stores it.
        module, _, leaf = key.rpartition(".")
        if stacked and leaf == "weight" and values[key].ndim == 3:
            for index in range(num_layers):
                values[f"{module}._extra_state/shard_{index}_{num_layers}"] = [None]
    common = {
        "args": _torch_dist_args(space.args),
        "checkpoint_version": space.checkpoint_version,
        "iteration": space.iteration,
        "optimizer": optimizer,
        "opt_param_scheduler": space.scheduler,
        "num_floating_point_operations_so_far": space.flops,
        "content_metadata": metadata,
    }
    values[COMMON_KEY] = [common]
    return values

"""Megatron's ``fsdp_dtensor`` checkpoints (Megatron-FSDP), read and written in model space
(``convert.names`` lists the keys).

Read and written: ``model.module.<name>`` weights, Adam's state per param
(``optimizer.state.module.module.<name>.{exp_avg,exp_avg_sq,step}``) or, in a Muon run, a
matrix's momentum (``...<name>.momentum_buffer``, no step), each param's group fields
(``optimizer.param_to_group_meta...``), the scheduler's fields (``opt_param_scheduler.<field>``),
``args``, ``iteration``, ``checkpoint_version``, ``num_floating_point_operations_so_far``. Not
written: the RNG states (one per saving rank, no counterpart at another layout: load with
``--no-load-rng``). With ``--swiglu``, ``linear_fc1``'s halves ``_w`` / ``_v`` are the first and
second half of the model-space rows (torch_dist's gate-then-up order).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch

from megatron_muon.convert import names
from megatron_muon.convert.dcp_files import DcpFiles
from megatron_muon.convert.model_space import (
    ADAM_STATE,
    MUON_STATE,
    ConversionRefused,
    ModelSpace,
    check_source_args,
    refuse_unless,
)

__all__ = ["fsdp_dtensor_values", "read_fsdp_dtensor"]

_SCHEDULER_PREFIX = "opt_param_scheduler."
_COUNTERS = ("args", "iteration", "checkpoint_version", "num_floating_point_operations_so_far")


def _per_param(keys: list[str], prefix: str) -> dict[str, dict[str, str]]:
    """``prefix<name>.<leaf>`` keys -> {name: {leaf: key}}."""
    found: dict[str, dict[str, str]] = {}
    for key in keys:
        if key.startswith(prefix):
            name, _, leaf = key[len(prefix) :].rpartition(".")
            found.setdefault(name, {})[leaf] = key
    return found


def _join_halves(table: dict[str, Any], swiglu: bool, join: Any) -> dict[str, Any]:
    """swiglu's ``<name>_w`` and ``<name>_v`` entries (of ``linear_fc1``) -> one ``<name>`` entry,
    ``join(name, first, second)``; ``table`` as it is without swiglu."""
    if not swiglu:
        return table
    joined = dict(table)
    for name in [n for n in table if n.endswith("_w") and names.is_swiglu_fc1(n[:-2])]:
        whole = name[:-2]
        joined[whole] = join(whole, joined.pop(name), joined.pop(f"{whole}_v"))
    return joined


def _rows(_: str, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return torch.cat([first, second])


def _state_rows(_: str, first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> Any:
    return {kind: torch.cat([first[kind], second[kind]]) for kind in first}


def _alike(name: str, first: Any, second: Any) -> Any:
    """A per-param value both halves hold alike (step, group fields).

    Raises:
        ConversionRefused: the halves differ.
    """
    if first != second:
        raise ConversionRefused(f"{name}: its swiglu halves differ ({first}, {second})")
    return first


def read_fsdp_dtensor(directory: str) -> ModelSpace:
    """An ``fsdp_dtensor`` checkpoint (one ``iter_XXXXXXX`` directory) in model space.

    Raises:
        ConversionRefused: a layout or state without a torch_dist counterpart (named).
    """
    files = DcpFiles(directory)
    objects = sorted(files.object_keys)
    refuse_unless(
        all(k in files.object_keys for k in _COUNTERS),
        f"{directory}: not a Megatron-LM fsdp_dtensor checkpoint (it lacks {list(_COUNTERS)})",
    )
    read = files.objects([k for k in objects if not k.startswith("rng_state")])
    args = read["args"]
    check_source_args(args, directory)
    swiglu = bool(getattr(args, "swiglu", False))
    weights = {
        key[len(names.FSDP_MODEL_PREFIX) :]: key
        for key in files.tensor_keys
        if key.startswith(names.FSDP_MODEL_PREFIX)
    }
    state_keys = _per_param(list(files.tensor_keys), names.FSDP_STATE_PREFIX)
    kinds = {kind for leaves in state_keys.values() for kind in leaves}
    mapped = {*ADAM_STATE, "step", *(MUON_STATE if args.optimizer == "muon" else ())}
    refuse_unless(
        kinds <= mapped,
        f"{directory}: optimizer state {sorted(kinds - mapped)}: no torch_dist counterpart in "
        f"megatron-core's {args.optimizer} (mapped: {sorted(mapped)})",
    )
    tensors = files.tensors(
        [*weights.values(), *(k for v in state_keys.values() for k in v.values())]
    )
    params = _join_halves({n: tensors[k] for n, k in weights.items()}, swiglu, _rows)
    state = {
        n: {kind: tensors[k] for kind, k in v.items() if kind != "step"}
        for n, v in state_keys.items()
    }
    steps = {n: float(tensors[v["step"]]) for n, v in state_keys.items() if "step" in v}
    metas = _per_param(objects, names.FSDP_META_PREFIX)
    groups = {n: {leaf: read[k] for leaf, k in leaves.items()} for n, leaves in metas.items()}
    scheduler = {
        k[len(_SCHEDULER_PREFIX) :]: read[k] for k in objects if k.startswith(_SCHEDULER_PREFIX)
    }
    return ModelSpace(
        params=params,
        state=_join_halves(state, swiglu, _state_rows),
        steps=_join_halves(steps, swiglu, _alike),
        groups=_join_halves(groups, swiglu, _alike),
        scheduler=scheduler,
        args=args,
        iteration=int(read["iteration"]),
        flops=float(read["num_floating_point_operations_so_far"]),
        checkpoint_version=float(read["checkpoint_version"]),
    )


# --------------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------------


def _fsdp_args(args: argparse.Namespace) -> argparse.Namespace:
    converted = copy.copy(args)
    converted.ckpt_format = "fsdp_dtensor"
    converted.use_megatron_fsdp = True
    converted.use_distributed_optimizer = True
    converted.use_layer_wise_distributed_optimizer = False
    return converted


def _split(name: str, value: torch.Tensor, swiglu: bool) -> dict[str, torch.Tensor]:
    """{fsdp_dtensor name: tensor}: the param itself, or swiglu's two halves of its rows."""
    split = names.fsdp_names(name, swiglu)
    if len(split) == 1:
        return {name: value}
    first, second = torch.chunk(value, 2, dim=0)
    return {split[0]: first.clone(), split[1]: second.clone()}


def fsdp_dtensor_values(space: ModelSpace) -> dict[str, Any]:
    """The flat ``{key: value}`` of the fsdp_dtensor checkpoint of ``space``."""
    values: dict[str, Any] = {
        "args": _fsdp_args(space.args),
        "iteration": space.iteration,
        "checkpoint_version": space.checkpoint_version,
        "num_floating_point_operations_so_far": space.flops,
    }
    for name, weight in space.params.items():
        for part, tensor in _split(name, weight, space.swiglu).items():
            values[names.FSDP_MODEL_PREFIX + part] = tensor
        state = space.state[name]
        halves = {kind: _split(name, tensor, space.swiglu) for kind, tensor in state.items()}
        for part in names.fsdp_names(name, space.swiglu):
            prefix = f"{names.FSDP_STATE_PREFIX}{part}."
            for kind in state:
                values[prefix + kind] = halves[kind][part]
            if name in space.steps:  # Adam's; Muon's matrices keep none
                values[prefix + "step"] = torch.tensor(space.steps[name], dtype=torch.float32)
            for field, value in space.groups[name].items():
                values[f"{names.FSDP_META_PREFIX}{part}.{field}"] = value
    for field, value in space.scheduler.items():
        values[_SCHEDULER_PREFIX + field] = value
    return values

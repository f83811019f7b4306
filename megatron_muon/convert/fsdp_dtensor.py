"""Megatron's ``fsdp_dtensor`` checkpoints (Megatron-FSDP), read and written in model space
(``convert.names`` lists the keys).

Read and written: ``model.module.<name>`` weights, Adam's state per param
(``optimizer.state.module.module.<name>.{exp_avg,exp_avg_sq,step}``), each param's group fields
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


def _join_swiglu(values: dict[str, Any], swiglu: bool) -> dict[str, Any]:
    """``<name>_w`` and ``<name>_v`` of swiglu's ``linear_fc1`` -> ``<name>`` (rows joined)."""
    if not swiglu:
        return values
    joined = dict(values)
    for name in [n for n in values if n.endswith("_w") and names.is_swiglu_fc1(n[:-2])]:
        whole = name[:-2]
        first, second = joined.pop(name), joined.pop(f"{whole}_v")
        joined[whole] = torch.cat([first, second]) if torch.is_tensor(first) else first
    return joined


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
    refuse_unless(
        kinds <= {*ADAM_STATE, "step"},
        f"{directory}: optimizer state {sorted(kinds - {*ADAM_STATE, 'step'})}: no torch_dist "
        "counterpart in megatron-core's Adam (only Adam's exp_avg, exp_avg_sq, step are mapped)",
    )
    tensors = files.tensors(
        [*weights.values(), *(k for v in state_keys.values() for k in v.values())]
    )
    params = _join_swiglu({n: tensors[k] for n, k in weights.items()}, swiglu)
    state = _join_state_halves(
        {
            n: {kind: tensors[k] for kind, k in v.items() if kind != "step"}
            for n, v in state_keys.items()
        },
        swiglu,
    )
    steps = {n: float(tensors[v["step"]]) for n, v in state_keys.items() if "step" in v}
    metas = _per_param(objects, names.FSDP_META_PREFIX)
    groups = {n: {leaf: read[k] for leaf, k in leaves.items()} for n, leaves in metas.items()}
    scheduler = {
        k[len(_SCHEDULER_PREFIX) :]: read[k] for k in objects if k.startswith(_SCHEDULER_PREFIX)
    }
    return ModelSpace(
        params=params,
        state=state,
        steps=_join_halves_alike(steps, swiglu),
        groups=_join_halves_alike(groups, swiglu),
        scheduler=scheduler,
        args=args,
        iteration=int(read["iteration"]),
        flops=float(read["num_floating_point_operations_so_far"]),
        checkpoint_version=float(read["checkpoint_version"]),
    )


def _join_state_halves(
    state: dict[str, dict[str, torch.Tensor]], swiglu: bool
) -> dict[str, dict[str, torch.Tensor]]:
    if not swiglu:
        return state
    joined = dict(state)
    for name in [n for n in state if n.endswith("_w") and names.is_swiglu_fc1(n[:-2])]:
        first, second = joined.pop(name), joined.pop(f"{name[:-2]}_v")
        joined[name[:-2]] = {kind: torch.cat([first[kind], second[kind]]) for kind in first}
    return joined


def _join_halves_alike(table: dict[str, Any], swiglu: bool) -> dict[str, Any]:
    """A per-param value the two halves hold alike (step, group fields) under the whole name.

    Raises:
        ConversionRefused: the halves differ.
    """
    if not swiglu:
        return table
    joined = dict(table)
    for name in [n for n in table if n.endswith("_w") and names.is_swiglu_fc1(n[:-2])]:
        first, second = joined.pop(name), joined.pop(f"{name[:-2]}_v")
        if first != second:
            raise ConversionRefused(f"{name[:-2]}: its swiglu halves differ ({first}, {second})")
        joined[name[:-2]] = first
    return joined


# --------------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------------


def _fsdp_args(args: argparse.Namespace) -> argparse.Namespace:
    converted = copy.copy(args)
    converted.ckpt_format = "fsdp_dtensor"
    converted.use_megatron_fsdp = True
    converted.use_distributed_optimizer = True
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
        halves = {kind: _split(name, space.state[name][kind], space.swiglu) for kind in ADAM_STATE}
        for part in names.fsdp_names(name, space.swiglu):
            prefix = f"{names.FSDP_STATE_PREFIX}{part}."
            for kind in ADAM_STATE:
                values[prefix + kind] = halves[kind][part]
            values[prefix + "step"] = torch.tensor(space.steps[name], dtype=torch.float32)
            for field, value in space.groups[name].items():
                values[f"{names.FSDP_META_PREFIX}{part}.{field}"] = value
    for field, value in space.scheduler.items():
        values[_SCHEDULER_PREFIX + field] = value
    return values

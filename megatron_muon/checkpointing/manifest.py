"""The manifest: a checkpoint's model and optimizer in words, and what differs from this run's.

Written into the completion marker at a save (``files.publish``); at a load every rank compares it
with the live model and optimizer before reading any state, so a checkpoint of another model
(param names, shapes, dtypes, buffers) or optimizer (which state each param holds, how params are
split into optimizers and groups) is refused naming what differs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_muon.checkpointing.errors import CheckpointMismatchError
from megatron_muon.checkpointing.fsdp_dtensor import Inventory
from megatron_muon.checkpointing.optimizer_state import expected_state_keys

__all__ = ["check_matches", "manifest_body"]

_MAX_LISTED_DIFFERENCES = 8


def _describe(tensor: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def manifest_body(inventory: Inventory, iteration: int, has_scheduler: bool) -> dict[str, Any]:
    """The manifest of this run's model and optimizer (JSON-serializable)."""
    params = {}
    for name, param in inventory.params:
        entry = _describe(param)
        if name in inventory.param_owner:
            leaf, group = inventory.param_owner[name]
            entry["optimizer"] = type(leaf).__name__
            entry["state"] = list(expected_state_keys(leaf, group))
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


def check_matches(path: str, saved: dict[str, Any], inventory: Inventory, scheduler: Any) -> None:
    """Raises unless checkpoint ``path``'s manifest ``saved`` matches this model and optimizer.

    Raises:
        CheckpointMismatchError: naming the first differences (at most 8, then how many more).
    """
    current = manifest_body(inventory, 0, scheduler is not None)
    differences = _differences(saved, current, scheduler)
    if differences:
        listed = differences[:_MAX_LISTED_DIFFERENCES]
        more = len(differences) - len(listed)
        raise CheckpointMismatchError(
            f"checkpoint {path} does not match this model/optimizer:\n  "
            + "\n  ".join(listed)
            + (f"\n  ... and {more} more" if more > 0 else "")
        )


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

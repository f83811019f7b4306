"""megatron-core's own Muon in ``torch_dist``: ``LayerWiseDistributedOptimizer``'s state, read into
model space and written from it.

Measured on megatron-core 0.19.2 (Megatron-LM's loop, ``--optimizer muon
--use-distributed-optimizer --ckpt-format torch_dist``, fp32 with ``integrations.layer_wise_fp32``;
the path Megatron-LM's config-container builder takes, which gives LayerWise no precomputed param
layout): the optimizer is a chain of two children, Muon over the matrices and AdamW over the rest
(embeddings, output layer, norms, biases). Each child's state is saved in model space under its
index, ``chained_<i>.optimizer.state.<kind>.<model key>`` (``momentum_buffer`` for Muon,
``exp_avg`` / ``exp_avg_sq`` for AdamW; the same stacked keys as the weights), whichever DP rank
owned the param; the common state's ``optimizer`` is ``{i: {"optimizer": {"param_groups": [...],
"state": {"common_step": <AdamW's step>}}}}`` (Muon keeps no step). The content metadata is the
distributed optimizer's default (``dp_reshardable``, which is what makes the ``chained_<i>.``
prefix), though LayerWise's children are no distributed optimizers: no flat buffers anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_muon.convert.model_space import (
    ADAM_STATE,
    MUON_STATE,
    ConversionRefused,
    ModelSpace,
    group_by_weight_decay,
    refuse_unless,
)

__all__ = [
    "CONTENT_METADATA",
    "LayerWiseChild",
    "child_state",
    "is_layer_wise",
    "layer_wise_children",
    "layer_wise_optimizer_values",
]

# What Megatron-LM's LayerWise save records (measured; ``chained_optim_avoid_prefix`` is ignored
# for a ``dp_reshardable`` type: the ``chained_<i>.`` prefix is written).
CONTENT_METADATA = {
    "distrib_optim_sharding_type": "dp_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}
# Child order as megatron-core builds it for Muon: the matrices' Muon first, then AdamW.
_KINDS_BY_CHILD = (MUON_STATE, ADAM_STATE)
_GROUP_KEYS_NOT_META = ("params", "step")


@dataclass
class LayerWiseChild:
    """One child of the chain: its index, the state kinds it keeps, its param groups by the
    weight-decay rule (``True``: the no-weight-decay group) and its step (None: Muon's)."""

    index: int
    kinds: tuple[str, ...]
    groups: dict[bool, dict[str, Any]]
    step: float | None

    def prefix(self, kind: str) -> str:
        return f"chained_{self.index}.optimizer.state.{kind}."


def is_layer_wise(common: dict[str, Any]) -> bool:
    """A torch_dist common state saved by ``LayerWiseDistributedOptimizer`` (``{i: {"optimizer":
    ...}}``, no distributed-optimizer sharding type)."""
    optimizer = common.get("optimizer")
    return (
        isinstance(optimizer, dict)
        and bool(optimizer)
        and all(isinstance(key, int) for key in optimizer)
        and all(isinstance(child, dict) and "optimizer" in child for child in optimizer.values())
    )


def layer_wise_children(
    common: dict[str, Any], tensor_keys: set[str], source: str
) -> list[LayerWiseChild]:
    """The chain's children, each with the state kinds its tensor keys hold.

    Raises:
        ConversionRefused: a child of neither Muon's nor AdamW's state, or AdamW without a step.
    """
    children = []
    for index, child in sorted(common["optimizer"].items()):
        optimizer = child["optimizer"]
        held = {
            kind
            for kind in (*MUON_STATE, *ADAM_STATE)
            if any(k.startswith(f"chained_{index}.optimizer.state.{kind}.") for k in tensor_keys)
        }
        kinds = next((k for k in _KINDS_BY_CHILD if set(k) == held), None)
        if kinds is None:
            raise ConversionRefused(
                f"{source}: LayerWise child {index} holds state {sorted(held)}: neither Muon's "
                f"{list(MUON_STATE)} nor AdamW's {list(ADAM_STATE)}"
            )
        state = optimizer.get("state") or {}
        step = state.get("common_step")
        refuse_unless(
            kinds == MUON_STATE or step is not None,
            f"{source}: LayerWise child {index} (AdamW) saved no common_step",
        )
        by_rule = group_by_weight_decay(list(optimizer["param_groups"]), source)
        groups = {
            rule: {k: v for k, v in group.items() if k not in _GROUP_KEYS_NOT_META}
            for rule, group in by_rule.items()
        }
        children.append(LayerWiseChild(index, kinds, groups, None if step is None else float(step)))
    return children


def child_state(key: str, children: list[LayerWiseChild], tensor_keys: set[str]) -> Any:
    """The child holding ``key``'s state and its state keys ``{kind: tensor key}``.

    Raises:
        ConversionRefused: no child, or more than one, holds state for ``key``.
    """
    found = [c for c in children if f"{c.prefix(c.kinds[0])}{key}" in tensor_keys]
    refuse_unless(len(found) == 1, f"{key}: held by {len(found)} LayerWise children, not 1")
    child = found[0]
    return child, {kind: f"{child.prefix(kind)}{key}" for kind in child.kinds}


def _child_of(space: ModelSpace, name: str) -> int:
    """0 for a Muon matrix, 1 for an AdamW param (``_KINDS_BY_CHILD``)."""
    return 0 if set(space.state[name]) == set(MUON_STATE) else 1


def _groups(space: ModelSpace, child: int) -> list[dict[str, Any]]:
    """The distinct group metas of the params of ``child``."""
    groups: list[dict[str, Any]] = []
    for name, meta in space.groups.items():
        if _child_of(space, name) == child and meta not in groups:
            groups.append(meta)
    return groups


def layer_wise_optimizer_values(
    space: ModelSpace, stacked: dict[str, list[tuple[int | None, str]]], join: Any
) -> tuple[dict[str, torch.Tensor], dict[int, Any]]:
    """The state tensors ``{key: tensor}`` and the common state's ``optimizer`` of ``space``
    (Muon and AdamW) as ``LayerWiseDistributedOptimizer`` saves them; ``stacked``: torch_dist key
    -> [(layer, name)]; ``join(tensors, stacked)``: the stacking.

    Raises:
        ConversionRefused: AdamW params with different steps (LayerWise keeps one).
    """
    values: dict[str, torch.Tensor] = {}
    for key, members in stacked.items():
        first = members[0][1]
        child = _child_of(space, first)
        for kind in space.state[first]:
            tensors = [space.state[name][kind] for _, name in members]
            values[f"chained_{child}.optimizer.state.{kind}.{key}"] = join(
                tensors, members[0][0] is not None
            )
    adam_steps = {space.steps[name] for name in space.params if _child_of(space, name) == 1}
    refuse_unless(len(adam_steps) <= 1, f"AdamW params with steps {sorted(adam_steps)}: one kept")
    adam_state = {"common_step": torch.tensor(adam_steps.pop())} if adam_steps else {}
    optimizer: dict[int, Any] = {
        0: {"optimizer": {"param_groups": _groups(space, 0)}},
        1: {"optimizer": {"state": adam_state, "param_groups": _groups(space, 1)}},
    }
    return values, optimizer

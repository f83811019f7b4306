"""Bring a run over to another optimizer at a load: ``--optimizer-switch-at-load``.

Megatron-LM's ``load_checkpoint`` reads an ``fsdp_dtensor`` checkpoint's optimizer state through
DCP, with the template the current optimizer's ``sharded_state_dict(is_loading=True)`` gives
(``{"state": {param name: {key: DTensor like the param | step}}, "param_to_group_meta": ...}``,
megatron-core's ``DistributedOptimizer`` for Adam and our ``MegatronCheckpointedOptimizer``
alike), then hands the filled template to ``optimizer.load_state_dict``. A checkpoint of another
optimizer holds other keys for some params (``momentum_buffer`` where this run keeps
``exp_avg``), which ``checkpoint_guards.optimizer_kind`` refuses by default. With the switch,
``switched_state`` rewrites both calls for the one load (``SwitchPlan``), per param:

- the optimizer that held it in each run (``holder``): AdamW where its param group is torch
  Adam's (a group with ``amsgrad``: the params Muon runs route to AdamW, and all of an Adam run's),
  else the run's ``--optimizer`` (its ``fsdp.optimizer_registry`` entry);
- the same holder in both runs: every key loads as it was saved, bit for bit (AdamW's moments and
  ``step``);
- another holder: each state key of the new holder with a ``StateCounterpart`` of the same
  quantity in the old one loads the old key's tensor into the new key's, bit for bit (Adam's
  ``exp_avg`` into Muon's ``momentum_buffer``: the same ``lerp_`` average of the same gradients,
  equal when ``muon_momentum`` = ``adam_beta1``; the log says where the betas differ); every other
  key starts fresh: zeros, ``step`` 0, as the optimizer creates it before its first step. Into a
  ``whole_state`` optimizer (Adam) all of its keys are carried or none: Muon's momentum does not
  become ``exp_avg`` beside a fresh ``exp_avg_sq`` (``fsdp.optimizer_registry`` says why).

The load logs once per pair of holders (rank 0) what was carried, converted and started fresh.
The param groups' hyperparameters are this run's (the old optimizer's do not apply), the model,
scheduler, iteration and RNG load as Megatron loads them.

Checked against megatron-core 0.19.2 (``megatron_version.SUPPORTED_MEGATRON_CORE``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_muon.common.console import print_rank_0
from megatron_muon.fsdp.optimizer_registry import OptimizerEntry, lookup

__all__ = ["ADAMW", "SwitchPlan", "holder_of", "switched_state"]

#: The holder name of the params on torch's Adam/AdamW (``OPTIMIZERS["adam"]``).
ADAMW = "adam"
_STATE_PREFIX = "optimizer.state."
_GROUP_PREFIX = "optimizer.param_to_group_meta."


def holder_of(group_keys: set[str] | dict, run_optimizer: str) -> str:
    """The optimizer holding a param: AdamW where its param group is torch Adam's (it has
    ``amsgrad``), else ``run_optimizer`` (the run's ``--optimizer``)."""
    return ADAMW if "amsgrad" in group_keys else run_optimizer


@dataclass
class _Pair:
    """What one (old holder, new holder) pair of params does with each new state key."""

    carried: dict[str, str] = field(default_factory=dict)  # new key -> old key
    fresh: list[str] = field(default_factory=list)
    params: int = 0


@dataclass
class SwitchPlan:
    """The checkpoint's side of a switched load: its ``--optimizer`` and, per param name, its
    state keys and whether its group was Adam's (from the DCP metadata: every rank alike)."""

    saved_optimizer: str
    run_optimizer: str
    saved_keys: dict[str, set[str]]
    saved_adam: set[str]
    betas: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)

    @classmethod
    def from_metadata(
        cls, keys: Any, saved_optimizer: str, run_optimizer: str, saved_args: Any, args: Any
    ) -> SwitchPlan:
        """The plan from the checkpoint's DCP metadata keys and the ``args`` saved with it."""
        saved_keys: dict[str, set[str]] = {}
        saved_adam: set[str] = set()
        for key in keys:
            if key.startswith(_STATE_PREFIX):
                name, state_key = key[len(_STATE_PREFIX) :].rsplit(".", 1)
                saved_keys.setdefault(name, set()).add(state_key)
            elif key.startswith(_GROUP_PREFIX) and key.endswith(".amsgrad"):
                saved_adam.add(key[len(_GROUP_PREFIX) : -len(".amsgrad")])
        plan = cls(saved_optimizer, run_optimizer, saved_keys, saved_adam)
        for entry_name in {saved_optimizer, run_optimizer, ADAMW}:
            for counterpart in lookup(entry_name).counterparts.values():
                plan.betas[counterpart.beta] = (
                    getattr(saved_args, counterpart.beta, None),
                    getattr(args, counterpart.beta, None),
                )
        return plan

    def saved_holder(self, name: str) -> str:
        return ADAMW if name in self.saved_adam else self.saved_optimizer

    def pair(self, old: OptimizerEntry, new: OptimizerEntry, new_keys: list[str]) -> _Pair:
        """Which new key loads from which old key (module docstring), which start fresh."""
        pair = _Pair()
        for key in new_keys:
            if old.name == new.name and key in old.state_keys:
                pair.carried[key] = key
                continue
            counterpart = new.counterparts.get(key)
            match = [
                old_key
                for old_key, old_counterpart in old.counterparts.items()
                if counterpart is not None and old_counterpart.quantity == counterpart.quantity
            ]
            if match:
                pair.carried[key] = match[0]
            else:
                pair.fresh.append(key)
        if new.whole_state and old.name != new.name and pair.fresh:
            pair.fresh, pair.carried = list(new_keys), {}  # all of it or none
        return pair


def _state_dicts(template: Any) -> Iterator[dict]:
    """The ``{"state": ..., "param_to_group_meta": ...}`` dicts of an optimizer's state-dict
    template (one, or one per child of a ``ChainedOptimizer``)."""
    if isinstance(template, dict) and "state" in template and "param_to_group_meta" in template:
        yield template
    elif isinstance(template, dict):
        for value in template.values():
            yield from _state_dicts(value)


def _loaded_parts(state_dict: Any) -> Iterator[dict]:
    """The ``{"state": ...}`` dicts of what DCP filled, in ``_state_dicts``' order."""
    if isinstance(state_dict, dict) and "state" in state_dict:
        yield state_dict
    elif isinstance(state_dict, dict):
        for value in state_dict.values():
            yield from _loaded_parts(value)


@contextlib.contextmanager
def switched_state(optimizer: Any, plan: SwitchPlan) -> Iterator[None]:
    """Inside the block, ``optimizer``'s ``sharded_state_dict`` gives DCP the template of the
    checkpoint's keys (into this run's tensors) and its ``load_state_dict`` takes the result back
    to this run's keys, fresh keys zeroed (module docstring); restored afterwards."""
    own = {name: name in vars(optimizer) for name in ("sharded_state_dict", "load_state_dict")}
    originals = (optimizer.sharded_state_dict, optimizer.load_state_dict)
    kept: list[tuple[dict, dict]] = []  # (this run's state, fresh keys marked; its group meta)

    def sharded_state_dict(*args: Any, **kwargs: Any) -> Any:
        template = originals[0](*args, **kwargs)
        for part in list(_state_dicts(template)):
            state, meta = part["state"], part.pop("param_to_group_meta")
            part["state"] = _checkpoint_keys(plan, state, meta)  # marks the fresh keys in state
            kept.append((state, copy.deepcopy(meta)))
        return template

    def load_state_dict(state_dict: Any) -> None:
        parts = list(_loaded_parts(state_dict))
        assert len(parts) == len(kept), "one loaded state per template part"
        for part, (state, meta) in zip(parts, kept, strict=True):
            for values in state.values():
                for key in values.fresh:
                    values[key].zero_()
            part["state"] = {name: dict(values) for name, values in state.items()}
            part["param_to_group_meta"] = meta
        originals[1](state_dict)

    optimizer.sharded_state_dict = sharded_state_dict
    optimizer.load_state_dict = load_state_dict
    try:
        yield
    finally:
        for name, value in zip(own, originals, strict=True):
            if own[name]:
                setattr(optimizer, name, value)
            else:
                delattr(optimizer, name)


class _Keys(dict):
    """A param's state (this run's keys), remembering which keys start fresh."""

    fresh: tuple[str, ...] = ()


def _checkpoint_keys(plan: SwitchPlan, state: dict, meta: dict) -> dict[str, dict[str, Any]]:
    """The DCP template: per param, the checkpoint's key for each carried tensor (this run's
    tensor, filled in place); marks the fresh keys in ``state`` and logs each pair once."""
    template: dict[str, dict[str, Any]] = {}
    pairs: dict[tuple[str, str], _Pair] = {}
    for name, values in state.items():
        old = lookup(plan.saved_holder(name))
        new = lookup(holder_of(meta.get(name, {}), plan.run_optimizer))
        keys = [key for key, value in values.items() if torch.is_tensor(value)]
        pair = pairs.setdefault((old.name, new.name), plan.pair(old, new, keys))
        pair.params += 1
        saved = plan.saved_keys.get(name, set())
        carried = {k: v for k, v in pair.carried.items() if v in saved}
        template[name] = {old_key: values[key] for key, old_key in carried.items()}
        marked = _Keys(values)
        marked.fresh = tuple(key for key in keys if key not in carried)
        state[name] = marked
    for (old_name, new_name), pair in pairs.items():
        print_rank_0(_log_line(plan, lookup(old_name), lookup(new_name), pair))
    return template


def _log_line(plan: SwitchPlan, old: OptimizerEntry, new: OptimizerEntry, pair: _Pair) -> str:
    """``megatron-muon optimizer switch: <old> -> <new>: <n> params: carried ...; fresh ...``."""
    parts = []
    for key, old_key in pair.carried.items():
        if old.name == new.name:
            parts.append(f"{key} carried bitwise")
            continue
        quantity = new.counterparts[key]
        old_beta = old.counterparts[old_key].beta
        saved, mine = plan.betas.get(old_beta, (None, None))[0], plan.betas.get(quantity.beta)
        mine_value = mine[1] if mine else None
        relation = "the same average" if saved == mine_value else "other betas: another weighting"
        parts.append(
            f"{key} <- {old_key} bitwise ({quantity.quantity}: {old.name} {old_beta}={saved}, "
            f"{new.name} {quantity.beta}={mine_value}: {relation})"
        )
    fresh = f"; fresh: {', '.join(pair.fresh)}" if pair.fresh else ""
    return (
        f"megatron-muon optimizer switch: {old.name} -> {new.name}: {pair.params} params: "
        f"{'; '.join(parts) or 'nothing carried'}{fresh}"
    )

"""megatron-core's ``DistributedOptimizer`` over torch's Adam resumes from a ``torch_dist``
checkpoint, exactly.

Without Apex or Transformer Engine (every CPU machine, and a GPU machine without them:
``distrib_optimizer.HAVE_APEX_OR_TE`` is False), megatron-core 0.19.2's
``DistributedOptimizer.state_dict()`` reads Adam's step from torch Adam's per-param state (``assert
len(steps) == 1``, distrib_optimizer.py:839); Megatron-LM's ``load_checkpoint`` calls it to build
the sharded state dict it loads into, in a fresh process whose Adam has no state yet (torch's Adam
creates it at the first step), so every ``--load`` of a Megatron-DDP ``--use-distributed-optimizer``
run stopped there (measured: 2 CPU ranks, ``--ckpt-format torch_dist
--dist-ckpt-optim-fully-reshardable``, ``AssertionError`` on every rank). With Transformer Engine's
FusedAdam (a GPU) the step is read from the param groups instead.

The load then stopped one step later: ``load_state_dict`` puts the step (from the param groups) into
each param's Adam state, and ``_set_main_param_and_optimizer_states`` copies the checkpoint's
tensors into every tensor of that state, ``step`` included, which the checkpoint holds per group,
not per param (``KeyError: 'step'``, distrib_optimizer.py:1223).

And a resumed run then stepped wrong: ``load_state_dict`` gives every param's Adam state the same
step tensor (``s["step"] = step`` for each, distrib_optimizer.py:1032), which torch's
``load_state_dict`` keeps shared, and torch's Adam increments each param's step in place, so one
optimizer step advanced the shared count once per param (measured: 4 -> 20 -> 36 on a rank with 16
params), Adam's bias correction was that of step 20 at step 5, and a resume at the same layout left
the uninterrupted run at the first update after the load (grad norm 2.3652 against 2.3922).

The fix (``patch()``, applied by ``megatron_lm.install()`` under its megatron-core version check;
nothing where Apex or Transformer Engine is installed): where the inner Adam holds no state at all,
``state_dict()`` first gives each of its params the state Adam's first step would create before
updating it (``step`` 0, zero moments); the load then overwrites all of it (moments from the
checkpoint, the step from its param groups). Once Adam holds state (after a step, or after the load)
it changes nothing. And the copy of a param's loaded tensors leaves its ``step`` as
``load_state_dict`` set it (the tensors it gets name no ``step``: one entry ``None``, which the copy
skips), and after ``load_state_dict`` each param holds a step tensor of its own (the same value).
Numerics otherwise unchanged: a resume is then bitwise the uninterrupted run.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["patch"]

_MARK = "_megatron_muon_resumes_exactly"


def _give_adam_its_initial_state(adam: torch.optim.Optimizer) -> None:
    """Each param of ``adam`` (torch Adam/AdamW, no state yet): step 0, zero moments."""
    for group in adam.param_groups:
        for param in group["params"]:
            adam.state[param] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }


def patch() -> None:
    """``DistributedOptimizer``'s load over torch's Adam without Apex or TE (module docstring)."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    owner = distrib_optimizer.DistributedOptimizer
    original = owner.state_dict
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def state_dict(self: Any) -> Any:
        adam = self.optimizer
        if isinstance(adam, torch.optim.Adam | torch.optim.AdamW) and not any(adam.state.values()):
            _give_adam_its_initial_state(adam)
        return original(self)

    setattr(state_dict, _MARK, True)
    owner.state_dict = state_dict
    copy = owner._set_main_param_and_optimizer_states

    @functools.wraps(copy)
    def set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: Any) -> Any:
        return copy(self, model_param, {"step": None, **tensors})

    owner._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
    load_state_dict = owner.load_state_dict

    @functools.wraps(load_state_dict)
    def load_state_dict_with_own_steps(self: Any, state_dict: Any) -> Any:
        result = load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        return result

    owner.load_state_dict = load_state_dict_with_own_steps

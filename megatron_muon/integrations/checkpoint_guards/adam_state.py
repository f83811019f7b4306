"""Megatron ``fsdp_dtensor`` checkpoints of Adam in the pretrain entry point: saved, never hung.

One way stock megatron-core 0.19.2 hangs in Megatron-LM's loop with ``--use-megatron-fsdp``,
measured through ``python -m megatron_muon.pretrain`` on 2 CPU ranks, and what ``install()`` (called
by that entry point only; Megatron-LM scripts with ``megatron_lm.install()`` alone keep stock Adam)
does: ``--optimizer adam --save``: torch's Adam creates its state lazily, for params that got a
gradient, and a rank holding 0 rows of a param never gets one, so the ranks' state keys differ and
the per-DTensor collectives of the fsdp_dtensor save fall out of step (the run hung at "Storing
distributed optimizer sharded state"). Here ``get_megatron_optimizer``'s Adam gets every param's
state at build time, without a step (``make_adam_state_rank_symmetric``), and before each save the
per-param ``step`` counts are made equal over the param's ranks (a rank with 0 rows never stepped
it; DCP keeps one rank's copy of such a replicated value). With that state, a ``--load`` of a
checkpoint of another optimizer is refused for Adam runs too (``checkpoint_guards.optimizer_kind``,
which ``megatron_lm.install()`` applies).

Checked against megatron-core 0.19.2 (``megatron_version.SUPPORTED_MEGATRON_CORE``).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from megatron_muon.checkpointing import (
    ensure_optimizer_state,
    leaf_optimizers,
)
from megatron_muon.checkpointing.optimizer_state import creates_state
from megatron_muon.integrations import megatron_lm

__all__ = ["install", "make_adam_state_rank_symmetric"]

_INSTALLED = False


def install() -> None:
    """Wraps ``get_megatron_optimizer`` as ``megatron.training.training`` calls it (after
    ``megatron_lm.install()``; idempotent)."""
    global _INSTALLED
    megatron_lm.install()
    if _INSTALLED:
        return
    training: Any = importlib.import_module("megatron.training.training")
    training.get_megatron_optimizer = _with_rank_symmetric_adam_state(
        training.get_megatron_optimizer
    )
    _INSTALLED = True


# --------------------------------------------------------------------------------------------------
# 1. Adam's state on every rank
# --------------------------------------------------------------------------------------------------


def _children(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def make_adam_state_rank_symmetric(optimizer: Any) -> None:
    """Every param's Adam state on every rank, now (no step) and before each state-dict save.

    Collective over each param's data-parallel mesh. ``optimizer``: megatron-core's optimizer for a
    Megatron-FSDP model (a ``DistributedOptimizer``, or a ``ChainedOptimizer`` of them) over
    torch ``Adam``/``AdamW`` (state as ``checkpointing``'s ``create_state`` makes it); others
    (Transformer Engine's ``FusedAdam``, which keeps ``step`` per group) get megatron-core's own
    ``init_state_fn``.
    """
    for child in _children(optimizer):
        leaves = leaf_optimizers(child)
        if all(creates_state(leaf) for leaf in leaves):
            ensure_optimizer_state(child)
            child.sharded_state_dict = _with_equal_steps(child, child.sharded_state_dict)
        elif getattr(child, "init_state_fn", None) is not None:
            child.init_state_fn(child.optimizer, child.config)


def _with_equal_steps(child: Any, sharded_state_dict: Any) -> Any:
    @functools.wraps(sharded_state_dict)
    def sharded_state_dict_with_equal_steps(*args: Any, **kwargs: Any) -> Any:
        ensure_optimizer_state(child)  # steps: the max over each param's mesh
        return sharded_state_dict(*args, **kwargs)

    return sharded_state_dict_with_equal_steps


def _with_rank_symmetric_adam_state(get_megatron_optimizer: Any) -> Any:
    @functools.wraps(get_megatron_optimizer)
    def get_optimizer_with_state(config: Any, model_chunks: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer = get_megatron_optimizer(config, model_chunks, *args, **kwargs)
        if config.optimizer == "adam" and megatron_lm.uses_megatron_fsdp(model_chunks):
            make_adam_state_rank_symmetric(optimizer)
        return optimizer

    return get_optimizer_with_state

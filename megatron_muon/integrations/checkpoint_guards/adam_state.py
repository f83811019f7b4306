"""Megatron ``fsdp_dtensor`` checkpoints of stock Adam on Megatron-FSDP: saved, never hung.

One way stock megatron-core 0.19.2 hangs in Megatron-LM's loop with ``--use-megatron-fsdp``,
measured with ``pretrain_gpt.py`` on 2 CPU ranks (the tiny GPT), and what ``install()``
(``megatron_lm.install()``, which every Megatron-LM script with megatron-muon calls, and so
``python -m megatron_muon.pretrain``) does: ``--optimizer adam --save``: torch's Adam creates its
state lazily, for params that got a gradient, and a rank holding 0 rows of a param never gets
one, so the ranks' state keys differ and the per-DTensor collectives of the fsdp_dtensor save fall
out of step (the run hung at "Storing distributed optimizer sharded state" until gloo's 600 s
timeout, leaving an empty ``iter_0000004/``). torch's SGD keeps its ``momentum_buffer`` the same
lazy way (with megatron-core's ``--sgd-momentum``, 0.9 by default), but megatron-core 0.19.2's
``DistributedOptimizer`` refuses SGD, so a stock ``--optimizer sgd --use-megatron-fsdp`` run
stops at build: ``install()`` routes it to megatron-muon's factory (``fsdp.optimizer_registry``),
whose SGD holds its buffer from the build on (as zeros, which its first step turns into the
gradient bit for bit, as torch's own first step sets it). Here ``get_megatron_optimizer``'s
Adam gets every param's state at build time, without a step
(``make_adam_state_rank_symmetric``), and before each save Adam's per-param
``step`` counts are made equal over the param's ranks (a rank with 0 rows never stepped it; DCP
keeps one rank's copy of such a replicated value). With that state, a ``--load`` of a checkpoint
of another optimizer is refused for Adam runs too (``checkpoint_guards.optimizer_kind``).

Checked against megatron-core 0.19.2 (``megatron_version.SUPPORTED_MEGATRON_CORE``).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from typing import Any

from megatron_muon.checkpointing import (
    ensure_optimizer_state,
    leaf_optimizers,
)
from megatron_muon.checkpointing.optimizer_state import creates_state
from megatron_muon.common.megatron_fsdp_compat import uses_megatron_fsdp

__all__ = ["install", "make_adam_state_rank_symmetric", "with_rank_symmetric_state"]

#: The ``--optimizer`` values megatron-core builds itself on Megatron-FSDP (its
#: ``DistributedOptimizer`` over torch's class), whose state is made rank-symmetric here (SGD,
#: which that class refuses, megatron-muon builds: ``fsdp.optimizer_registry``).
STOCK_OPTIMIZERS = ("adam",)


# Set on our get_megatron_optimizer (``functools.wraps`` carries it through later wrappers).
_MARK = "_megatron_muon_rank_symmetric_state"


def install() -> None:
    """Deprecated: ``megatron_muon.integrations.megatron_lm.install()`` applies this fix.

    Wraps ``get_megatron_optimizer`` as ``megatron.training.training`` calls it (idempotent, also
    after ``megatron_lm.install()``)."""
    warnings.warn(
        "megatron_muon.integrations.checkpoint_guards.adam_state.install() is deprecated: "
        "megatron_muon.integrations.megatron_lm.install() applies it",
        DeprecationWarning,
        stacklevel=2,
    )
    training: Any = importlib.import_module("megatron.training.training")
    training.get_megatron_optimizer = with_rank_symmetric_state(training.get_megatron_optimizer)


# --------------------------------------------------------------------------------------------------
# 1. Adam's and SGD's state on every rank
# --------------------------------------------------------------------------------------------------


def _children(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def make_adam_state_rank_symmetric(optimizer: Any) -> None:
    """Every param's Adam (or SGD) state on every rank, now (no step) and before each save.

    Collective over each param's data-parallel mesh. ``optimizer``: megatron-core's optimizer for a
    Megatron-FSDP model (a ``DistributedOptimizer``, or a ``ChainedOptimizer`` of them) over
    torch ``Adam``/``AdamW``/``SGD`` (state as ``checkpointing``'s ``create_state`` makes it);
    others (Transformer Engine's ``FusedAdam``, which keeps ``step`` per group) get
    megatron-core's own ``init_state_fn``.
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


def with_rank_symmetric_state(get_megatron_optimizer: Any) -> Any:
    """``get_megatron_optimizer`` whose Adam for Megatron-FSDP chunks holds every param's
    state on every rank (``make_adam_state_rank_symmetric``); any other optimizer as it was.
    Idempotent: a function that already does it (also under later wrappers, which
    ``functools.wraps`` gives the mark) is returned as it is."""
    if getattr(get_megatron_optimizer, _MARK, False):
        return get_megatron_optimizer

    @functools.wraps(get_megatron_optimizer)
    def get_optimizer_with_state(config: Any, model_chunks: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer = get_megatron_optimizer(config, model_chunks, *args, **kwargs)
        if config.optimizer in STOCK_OPTIMIZERS and uses_megatron_fsdp(model_chunks):
            make_adam_state_rank_symmetric(optimizer)
        return optimizer

    setattr(get_optimizer_with_state, _MARK, True)
    return get_optimizer_with_state

"""Megatron ``fsdp_dtensor`` checkpoints in the pretrain entry point: saved and loaded, never hung.

Two ways stock megatron-core 0.19.2 hangs in Megatron-LM's loop with ``--use-megatron-fsdp``, both
measured through ``python -m megatron_muon.pretrain`` on 2 CPU ranks, and what ``install()`` (called
by that entry point only; Megatron-LM scripts with ``megatron_lm.install()`` alone stay stock) does:

1. ``--optimizer adam --save``: torch's Adam creates its state lazily, for params that got a
   gradient, and a rank holding 0 rows of a param never gets one, so the ranks' state keys differ
   and the per-DTensor collectives of the fsdp_dtensor save fall out of step (the run hung at
   "Storing distributed optimizer sharded state"). Here ``get_megatron_optimizer``'s Adam gets
   every param's state at build time, without a step (``make_adam_state_rank_symmetric``), and
   before each save the per-param ``step`` counts are made equal over the param's ranks (a rank
   with 0 rows never stepped it; DCP keeps one rank's copy of such a replicated value).
2. ``--load`` of a checkpoint whose optimizer state is of another kind (a Muon run's
   ``momentum_buffer`` into an Adam run, or the reverse): Megatron's partial load then waits in
   collectives for state the checkpoint does not hold. Here ``load_checkpoint`` first compares the
   optimizer state keys in the checkpoint's DCP metadata with this run's and raises
   ``CheckpointMismatchError`` on every rank (each reads the same file) before any collective;
   ``--no-load-optim`` and ``--finetune`` skip the optimizer state and the check.

Checked against megatron-core 0.19.2 (``megatron_version.SUPPORTED_MEGATRON_CORE``).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

from megatron_muon.checkpointing import (
    CheckpointMismatchError,
    ensure_optimizer_state,
    leaf_optimizers,
)
from megatron_muon.checkpointing.optimizer_state import creates_state
from megatron_muon.integrations import megatron_lm
from megatron_muon.integrations.megatron_checkpoint import checkpoint_directory

__all__ = [
    "install",
    "make_adam_state_rank_symmetric",
    "check_optimizer_state_kinds",
    "optimizer_of_state",
    "state_kinds_refusal",
]

_INSTALLED = False
_OPTIMIZER_PREFIX = "optimizer.state."


def install() -> None:
    """Wraps ``get_megatron_optimizer`` and ``load_checkpoint`` as ``megatron.training.training``
    calls them (after ``megatron_lm.install()``; idempotent)."""
    global _INSTALLED
    megatron_lm.install()
    if _INSTALLED:
        return
    training: Any = importlib.import_module("megatron.training.training")
    training.get_megatron_optimizer = _with_rank_symmetric_adam_state(
        training.get_megatron_optimizer
    )
    training.load_checkpoint = _checking_optimizer_state_first(training.load_checkpoint)
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


# --------------------------------------------------------------------------------------------------
# 2. the checkpoint's optimizer state kinds against this run's
# --------------------------------------------------------------------------------------------------


def _saved_state_kinds(directory: str) -> list[set[str]]:
    """The optimizer state keys (``exp_avg``, ``momentum_buffer``, ...) a DCP checkpoint holds,
    per param (a key ``optimizer.state.<param>.<kind>``)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(directory).read_metadata().state_dict_metadata
    by_param: dict[str, set[str]] = {}
    for key in keys:
        if key.startswith(_OPTIMIZER_PREFIX) and "." in key[len(_OPTIMIZER_PREFIX) :]:
            param, kind = key.rsplit(".", 1)
            by_param.setdefault(param, set()).add(kind)
    return list(by_param.values())


def _run_state_kinds(optimizer: Any) -> list[set[str]]:
    return [set(state) for leaf in leaf_optimizers(optimizer) for state in leaf.state.values()]


def optimizer_of_state(kinds: list[set[str]]) -> str | None:
    """The ``--optimizer`` whose state holds these per-param keys: a second moment next to Muon's
    momentum is adaptive_muon's, Muon's momentum alone muon's, a first moment without a second
    one (``exp_avg`` without ``exp_avg_sq``: Lion's, beside AdamW's for the other params) lion's,
    Adam's two moments alone adam's. None: none of these (nothing to name)."""
    union = set().union(*kinds) if kinds else set()
    if "moment2_buffer" in union:
        return "adaptive_muon"
    if "momentum_buffer" in union:
        return "muon"
    if any("exp_avg" in k and "exp_avg_sq" not in k for k in kinds):
        return "lion"
    if "exp_avg_sq" in union:
        return "adam"
    return None


def state_kinds_refusal(
    saved: list[set[str]], mine: list[set[str]], optimizer: str, load: str, directory: str
) -> str | None:
    """Why the optimizer state ``saved`` (per param) cannot load into this run's (``mine``,
    ``--optimizer optimizer``): the keys differ, or the state is another optimizer's (Lion's and
    Adam's keys are the same names, held by different params). None: it can."""
    if not saved or not mine:
        return None
    saved_union, mine_union = set().union(*saved), set().union(*mine)
    saved_by, mine_by = optimizer_of_state(saved), optimizer_of_state(mine)
    if saved_union == mine_union and saved_by == mine_by:
        return None
    by = f" (saved by --optimizer {saved_by})" if saved_by is not None else ""
    return (
        f"--load {load}: checkpoint {directory}{by} holds optimizer state "
        f"{sorted(saved_union)}, this run's --optimizer {optimizer} keeps {sorted(mine_union)} "
        "(saved by a run with another --optimizer?). Pass --no-load-optim to load the weights "
        "alone, or the --optimizer the checkpoint was saved with"
    )


def check_optimizer_state_kinds(args: Any, optimizer: Any) -> None:
    """Raises when the checkpoint ``--load`` reads holds optimizer state of another kind.

    Reads only the checkpoint's DCP metadata (every rank the same file: every rank decides alike).

    Raises:
        CheckpointMismatchError: the state keys differ (e.g. ``momentum_buffer`` from a Muon run
            loaded into ``--optimizer adam``), or they are another optimizer's
            (``state_kinds_refusal``); the message names both optimizers.
    """
    if (
        optimizer is None
        or getattr(args, "no_load_optim", False)
        or getattr(args, "finetune", False)
    ):
        return
    if getattr(args, "ckpt_format", None) != "fsdp_dtensor":
        return
    directory = checkpoint_directory(args)
    if directory is None or not os.path.isfile(os.path.join(directory, ".metadata")):
        return  # Megatron's own load reports a missing checkpoint
    refusal = state_kinds_refusal(
        _saved_state_kinds(directory),
        _run_state_kinds(optimizer),
        args.optimizer,
        args.load,
        directory,
    )
    if refusal is not None:
        raise CheckpointMismatchError(refusal)


def _checking_optimizer_state_first(load_checkpoint: Any) -> Any:
    @functools.wraps(load_checkpoint)
    def load_checkpoint_checked(model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        check_optimizer_state_kinds(get_args(), optimizer)
        return load_checkpoint(model, optimizer, *args, **kwargs)

    return load_checkpoint_checked

"""Megatron-Bridge's checkpoint load refuses what Megatron-LM's ``--load`` refuses, by name.

Bridge's ``_load_checkpoint_from_path`` (``megatron/bridge/training/checkpointing.py``: its
``load_checkpoint`` for a resume, its ``setup`` for a PEFT run's pretrained checkpoint) reads an
``fsdp_dtensor`` checkpoint through the same DCP reader as Megatron-LM's: DCP's ``.metadata`` with
``FileSystemReader.read_metadata`` (plain ``pickle.load``; once for the directory its tracker
names, once for the one it loads) and the values DCP stored whole with ``DefaultLoadPlanner.
load_bytes`` (``torch.load(weights_only=False)``). ``checking_bridge_load`` (applied by
``megatron_bridge.install()`` to both names) first, on every rank:

1. reads every pickle of the checkpoint directory the load reads (Bridge's own
   ``_resolve_checkpoint_iteration``: ``checkpoint.ckpt_step``, else its tracker) restricted
   (``checkpoint_guards.pickles.check_pickles_of``: the same ``UnsafeCheckpointError`` on every
   rank, naming the file and the global), then runs the load with DCP's reads restricted
   (``checkpoint_guards.pickles.restricted_dcp_reads``);
2. compares the checkpoint's optimizer state keys with this run's optimizer's
   (``checkpoint_guards.optimizer_kind.refuse_another_optimizers_state``): a Muon checkpoint loaded
   with ``optimizer="lion"`` raises ``CheckpointMismatchError`` naming both optimizers, where the
   load would wait in collectives for state the checkpoint does not hold. Skipped with
   ``checkpoint.load_optim=False`` or ``checkpoint.finetune`` (Bridge loads no optimizer state).

``MuonFsdpOptimizerConfig.ckpt_trust_pickles=True`` (Megatron-LM's ``--ckpt-trust-pickles``)
skips the restricted reads for a checkpoint the user trusts; the optimizer check stays.
``fsdp_dtensor`` only (``checkpoint.ckpt_format``; a HuggingFace directory is not DCP).

Checked against megatron-bridge 0.6.2 (``megatron_bridge.SUPPORTED_MEGATRON_BRIDGE``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

from megatron_muon.checkpointing import safe_unpickle
from megatron_muon.integrations.checkpoint_guards.optimizer_kind import (
    BRIDGE_NAMES,
    refuse_another_optimizers_state,
)
from megatron_muon.integrations.checkpoint_guards.pickles import (
    check_pickles_of,
    restricted_dcp_reads,
)

__all__ = ["bridge_checkpoint_directory", "checking_bridge_load", "install_load_checks"]

# Bridge's modules that call ``_load_checkpoint_from_path`` by this name (``setup`` imported it).
_CALLERS = ("megatron.bridge.training.checkpointing", "megatron.bridge.training.setup")
_LOAD = "_load_checkpoint_from_path"


def install_load_checks() -> None:
    """Wraps Bridge's ``_load_checkpoint_from_path`` with ``checking_bridge_load`` where Bridge
    calls it (module docstring). Not idempotent: ``megatron_bridge.install()`` calls it once."""
    for name in _CALLERS:
        module: Any = importlib.import_module(name)
        setattr(module, _LOAD, checking_bridge_load(getattr(module, _LOAD)))


def bridge_checkpoint_directory(load_dir: str | None, ckpt_step: int | None) -> str | None:
    """The ``iter_XXXXXXX`` directory Bridge's load of ``load_dir`` reads (``ckpt_step``, else
    its tracker; ``load_dir`` itself when it is one), or None. Collective where Bridge's tracker
    read is (rank 0 reads, broadcasts)."""
    checkpointing: Any = importlib.import_module("megatron.bridge.training.checkpointing")
    if load_dir is None or checkpointing.is_hf_checkpoint_dir(load_dir):
        return None
    iteration, release = checkpointing._resolve_checkpoint_iteration(load_dir, ckpt_step)
    if iteration == checkpointing._DIRECT_ITERATION_DIR_SENTINEL:
        return load_dir
    if iteration < 0:
        return None
    return str(checkpointing.get_checkpoint_name(load_dir, iteration, release))


def checking_bridge_load(load_from_path: Callable[..., Any]) -> Callable[..., Any]:
    """Bridge's ``_load_checkpoint_from_path`` after the checks of the module docstring."""
    signature = inspect.signature(load_from_path)

    @functools.wraps(load_from_path)
    def load_checked(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        cfg = bound.arguments["state"].cfg
        if cfg.checkpoint.ckpt_format != "fsdp_dtensor":
            return load_from_path(*args, **kwargs)
        load_dir = bound.arguments["load_dir"]
        step = None if bound.arguments["ignore_ckpt_step"] else cfg.checkpoint.ckpt_step
        directory = bridge_checkpoint_directory(load_dir, step)
        if getattr(cfg.optimizer, "ckpt_trust_pickles", False):
            _check_optimizer_state(cfg, bound.arguments["optimizer"], load_dir, directory)
            return load_from_path(*args, **kwargs)
        check_pickles_of(lambda: directory)
        with restricted_dcp_reads():
            _check_optimizer_state(cfg, bound.arguments["optimizer"], load_dir, directory)
            return load_from_path(*args, **kwargs)

    return load_checked


def _check_optimizer_state(cfg: Any, optimizer: Any, load_dir: str, directory: str | None) -> None:
    """``refuse_another_optimizers_state`` where Bridge loads ``optimizer``'s state from
    ``directory`` (Bridge's config ``cfg``)."""
    if (
        optimizer is None
        or not cfg.checkpoint.load_optim
        or cfg.checkpoint.finetune
        or directory is None
        or not os.path.isfile(os.path.join(directory, safe_unpickle.METADATA_NAME))
    ):
        return
    refuse_another_optimizers_state(
        directory, optimizer, cfg.optimizer.optimizer, load_dir, BRIDGE_NAMES
    )

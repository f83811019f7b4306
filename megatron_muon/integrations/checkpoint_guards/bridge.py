"""Megatron-Bridge's doors for a checkpoint, checked as Megatron-LM's (``readers``' guard).

Bridge (read in megatron-bridge 0.6.0's source; ``SUPPORTED_MEGATRON_BRIDGE`` pins 0.6.2) reads
a checkpoint at two doors, both through the same readers as Megatron-LM's (DCP's ``.metadata`` by
``pickle.load``, values stored whole by ``torch.load(weights_only=False)``, a ``torch_dist``
directory's ``common.pt`` by ``torch.load`` at torch's default):

- ``_load_checkpoint_from_path`` (``megatron/bridge/training/checkpointing.py``: its
  ``load_checkpoint`` for a resume or a ``pretrained_checkpoint``, its ``setup`` for a PEFT run's
  pretrained checkpoint). The directory is Bridge's own ``_resolve_checkpoint_iteration``'s
  (``checkpoint.ckpt_step``, else its tracker; ``load_dir`` itself when it is an iteration
  directory, whose format Bridge then picks from the files: ``_get_checkpoint_format``);
- ``has_modelopt_state`` / ``load_modelopt_state`` (``post_training/checkpointing.py``), which
  read ``modelopt_state/`` (megatron-core's ``load_common_state_dict``) while the model is built,
  before any load: of the iteration directory Bridge resolves, or, without one, of every
  ``iter_*`` directory (whose common state it reads to find the newest) and the root.

``install_load_checks`` (``megatron_bridge.install()``) wraps each: first, on every rank, the
format Bridge's ``_get_checkpoint_format`` picks for each directory the door reads, and
``readers.check_reads`` of it (the same ``UnsafeCheckpointError`` on every rank, naming the file
and the global or reason; a HuggingFace directory, read by Bridge's own safetensors path, is not
checked here), then the door with DCP's reads restricted (``pickles.restricted_dcp_reads``).
``_load_checkpoint_from_path`` also compares the checkpoint's optimizer state keys with this
run's optimizer's (``optimizer_kind.refuse_another_optimizers_state``): a Muon checkpoint loaded
with ``optimizer="lion"`` raises ``CheckpointMismatchError`` naming both optimizers, where the
load would wait in collectives for state the checkpoint does not hold (skipped with
``checkpoint.load_optim=False`` or ``checkpoint.finetune``: Bridge loads no optimizer state).

``MuonFsdpOptimizerConfig.ckpt_trust_pickles=True`` (Megatron-LM's ``--ckpt-trust-pickles``)
skips the restricted reads for a checkpoint the user trusts (for the ``modelopt_state`` doors,
which see no config, the last such config built in the process: ``trust_pickles``); the
optimizer check stays. Not run here: the Bridge tests need ``.venv-bridge``
(``scripts/setup_bridge_venv.sh``).
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
from megatron_muon.integrations.checkpoint_guards.pickles import restricted_dcp_reads
from megatron_muon.integrations.checkpoint_guards.readers import (
    MegatronRead,
    agreed,
    check_reads,
)

__all__ = [
    "bridge_checkpoint_directory",
    "check_bridge_directory",
    "checking_bridge_load",
    "checking_modelopt_reads",
    "install_load_checks",
    "trust_pickles",
]

# Bridge's modules that call ``_load_checkpoint_from_path`` by this name (``setup`` imported it).
_CALLERS = ("megatron.bridge.training.checkpointing", "megatron.bridge.training.setup")
_LOAD = "_load_checkpoint_from_path"
_MODELOPT = "megatron.bridge.training.post_training.checkpointing"
_MODELOPT_READERS = ("has_modelopt_state", "load_modelopt_state")
_MODELOPT_STATE = "modelopt_state"
_TRUSTED = {"pickles": False}


def trust_pickles(trusted: bool) -> None:
    """The ``modelopt_state`` doors read restricted unless ``trusted``
    (``MuonFsdpOptimizerConfig.ckpt_trust_pickles``, set when the config is built)."""
    _TRUSTED["pickles"] = trusted


def install_load_checks() -> None:
    """Wraps Bridge's ``_load_checkpoint_from_path`` with ``checking_bridge_load`` where Bridge
    calls it, and its ``has_modelopt_state`` / ``load_modelopt_state`` with
    ``checking_modelopt_reads`` (module docstring). Not idempotent: ``megatron_bridge.install()``
    calls it once."""
    for name in _CALLERS:
        module: Any = importlib.import_module(name)
        setattr(module, _LOAD, checking_bridge_load(getattr(module, _LOAD)))
    try:
        modelopt: Any = importlib.import_module(_MODELOPT)
    except ImportError:  # no nvidia-modelopt: Bridge's own import of this module fails the same
        return
    for name in _MODELOPT_READERS:
        setattr(modelopt, name, checking_modelopt_reads(getattr(modelopt, name)))


def check_bridge_directory(directory: str | None) -> None:
    """``readers.check_reads`` of ``directory`` as Bridge's ``_get_checkpoint_format`` reads it
    (nothing for None, a missing directory, a HuggingFace one, or one Bridge cannot read)."""
    checkpointing: Any = importlib.import_module("megatron.bridge.training.checkpointing")
    if directory is None or not os.path.isdir(directory):
        return
    try:
        found = checkpointing._get_checkpoint_format(directory)
    except NotImplementedError:  # Bridge raises the same, reading nothing
        return
    if found != "hf":
        check_reads(MegatronRead(directory, str(found)))


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
        load_dir = bound.arguments["load_dir"]
        step = None if bound.arguments["ignore_ckpt_step"] else cfg.checkpoint.ckpt_step
        directory = bridge_checkpoint_directory(load_dir, step)
        if getattr(cfg.optimizer, "ckpt_trust_pickles", False):
            _check_optimizer_state(cfg, bound.arguments["optimizer"], load_dir, directory)
            return load_from_path(*args, **kwargs)
        agreed(lambda: check_bridge_directory(directory))
        with restricted_dcp_reads():
            _check_optimizer_state(cfg, bound.arguments["optimizer"], load_dir, directory)
            return load_from_path(*args, **kwargs)

    return load_checked


def _modelopt_directories(checkpoint_path: str, ckpt_step: int | None) -> list[str]:
    """Every directory Bridge's ``_get_modelopt_checkpoint_path`` may read the common state of,
    and their ``modelopt_state`` (module docstring)."""
    if not checkpoint_path or not os.path.isdir(checkpoint_path):
        return []
    chosen = bridge_checkpoint_directory(checkpoint_path, ckpt_step)
    if chosen is not None:
        candidates = [chosen]
    else:  # Bridge reads each iter_* directory's common state to find the newest
        iterations = sorted(n for n in os.listdir(checkpoint_path) if n.startswith("iter_"))
        candidates = [os.path.join(checkpoint_path, n) for n in iterations] + [checkpoint_path]
    return [d for c in candidates for d in (c, os.path.join(c, _MODELOPT_STATE))]


def checking_modelopt_reads(read_modelopt: Callable[..., Any]) -> Callable[..., Any]:
    """Bridge's ``has_modelopt_state`` or ``load_modelopt_state`` after ``check_bridge_directory``
    of every directory it may read, inside ``restricted_dcp_reads`` (unless ``trust_pickles``)."""
    signature = inspect.signature(read_modelopt)

    @functools.wraps(read_modelopt)
    def read_checked(*args: Any, **kwargs: Any) -> Any:
        if _TRUSTED["pickles"]:
            return read_modelopt(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        path, step = bound.arguments["checkpoint_path"], bound.arguments.get("ckpt_step")

        def check() -> None:
            for directory in _modelopt_directories(path, step):
                check_bridge_directory(directory)

        agreed(check)
        with restricted_dcp_reads():
            return read_modelopt(*args, **kwargs)

    return read_checked


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

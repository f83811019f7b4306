"""Megatron-LM's doors for a checkpoint: each one through ``readers``' guard, then its reads
restricted.

Megatron's loads unpickle DCP's ``.metadata`` (``FileSystemReader.read_metadata``: plain
``pickle.load``), every value DCP stored whole (``args``, ``rng_state``, the scheduler's and param
groups' values: ``DefaultLoadPlanner.load_bytes``, ``torch.load(weights_only=False)``) and, for a
directory whose files make it ``torch_dist``, ``common.pt`` (``torch.load`` at torch's default).
Measured on megatron-core 0.19.2 with ``install()`` (2 CPU ranks): a ``.metadata`` replaced by a
pickle whose ``__reduce__`` runs a shell command, its SHA-256 in ``megatron_muon_files.json``
rewritten to match, ran the command at ``--load``; so did one read through
``--pretrained-checkpoint`` and ``--use-checkpoint-args``.

The doors (``megatron_lm.install()`` applies both wrappers):

- ``load_checkpoint`` (``refusing_unsafe_pickles``; ``megatron.training.training``'s name and
  ``megatron.training.checkpointing``'s): ``--load``, ``--pretrained-checkpoint`` when ``--load``
  holds no checkpoint (``--finetune`` or not), ``--ckpt-step``, non-persistent checkpoints, the
  RL reference model's load (``args.load = None``, then this same function), any
  ``--optimizer``, any ``--ckpt-format``;
- ``load_args_from_checkpoint`` (``refusing_unsafe_checkpoint_args``): ``--use-checkpoint-args``
  reads ``args`` from ``--pretrained-checkpoint`` and ``--load`` in ``parse_and_validate_args``,
  before ``torch.distributed`` is initialized (each process checks for itself).

Each first runs ``readers.guard_megatron_load`` (the directory and format Megatron will read,
every pickle its reader would read, restricted; every rank the same ``UnsafeCheckpointError``
naming the file and the global or reason), then Megatron's function with DCP's ``read_metadata``
and ``load_bytes`` reading restricted (``restricted_dcp_reads``: set on torch's classes for the
call, restored after), so a file swapped after the check is refused too.
``--ckpt-trust-pickles`` (``fsdp.arguments``) skips both, for a checkpoint the user trusts whose
pickles hold other types; no environment variable does (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
included).

Checked against megatron-core 0.19.2 (``megatron_version.SUPPORTED_MEGATRON_CORE``) and torch
2.14's ``FileSystemReader`` / ``DefaultLoadPlanner``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from megatron_muon.checkpointing import safe_unpickle
from megatron_muon.integrations.checkpoint_guards.readers import guard_megatron_load

__all__ = [
    "check_checkpoint_pickles",
    "install_other_doors",
    "refusing_unsafe_checkpoint_args",
    "refusing_unsafe_pickles",
    "restricted_dcp_reads",
    "trusts_pickles",
]


def trusts_pickles(args: Any) -> bool:
    """``--ckpt-trust-pickles``: the user vouches for the checkpoint's pickles."""
    return bool(getattr(args, "ckpt_trust_pickles", False))


@contextlib.contextmanager
def restricted_dcp_reads() -> Iterator[None]:
    """DCP's ``FileSystemReader.read_metadata`` and ``DefaultLoadPlanner.load_bytes`` read
    restricted (``safe_unpickle``) inside the block; torch's own afterwards."""
    read_metadata = FileSystemReader.read_metadata
    load_bytes = DefaultLoadPlanner.load_bytes
    FileSystemReader.read_metadata = safe_unpickle.restricted_read_metadata  # type: ignore[assignment]  # the same signature
    DefaultLoadPlanner.load_bytes = safe_unpickle.restricted_load_bytes  # type: ignore[assignment]  # the same signature
    try:
        yield
    finally:
        FileSystemReader.read_metadata = read_metadata  # type: ignore[method-assign]  # torch's own
        DefaultLoadPlanner.load_bytes = load_bytes  # type: ignore[method-assign]  # torch's own


def check_checkpoint_pickles(args: Any) -> None:
    """Every pickle of the checkpoint a ``load_checkpoint`` of ``args`` reads, read restricted
    (``readers.guard_megatron_load``). Collective (``agree``) where a process group exists.

    Raises (every rank the same):
        UnsafeCheckpointError: a pickle names a global outside ``safe_unpickle``'s allowlist, ...
    """
    guard_megatron_load(args)


def refusing_unsafe_pickles(load_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``load_checkpoint`` after ``guard_megatron_load`` (with its fallback to
    ``--pretrained-checkpoint``), inside ``restricted_dcp_reads``; unless
    ``--ckpt-trust-pickles``."""
    signature = inspect.signature(load_checkpoint)

    @functools.wraps(load_checkpoint)
    def load_checkpoint_restricted(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        megatron = get_args()
        if trusts_pickles(megatron):
            return load_checkpoint(*args, **kwargs)
        bound = signature.bind(*args, **kwargs).arguments
        guard_megatron_load(megatron, bound.get("load_arg", "load"), pretrained_fallback=True)
        with restricted_dcp_reads():
            return load_checkpoint(*args, **kwargs)

    return load_checkpoint_restricted


def refusing_unsafe_checkpoint_args(load_args: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``load_args_from_checkpoint`` after ``guard_megatron_load`` (the directory it
    is given, no fallback), inside ``restricted_dcp_reads``; unless ``--ckpt-trust-pickles``."""

    @functools.wraps(load_args)
    def load_args_restricted(args: Any, load_arg: str = "load", **kwargs: Any) -> Any:
        if trusts_pickles(args):
            return load_args(args, load_arg, **kwargs)
        guard_megatron_load(args, load_arg, pretrained_fallback=False)
        with restricted_dcp_reads():
            return load_args(args, load_arg, **kwargs)

    return load_args_restricted


def install_other_doors() -> None:
    """``refusing_unsafe_pickles`` on ``megatron.training.checkpointing.load_checkpoint`` (the
    name a script importing it after ``install()`` gets) and ``refusing_unsafe_checkpoint_args``
    on its ``load_args_from_checkpoint`` (``parse_and_validate_args`` imports it when called).
    ``megatron_lm.install()`` calls it once, beside its wrapping of ``training.load_checkpoint``."""
    checkpointing: Any = importlib.import_module("megatron.training.checkpointing")
    checkpointing.load_checkpoint = refusing_unsafe_pickles(checkpointing.load_checkpoint)
    checkpointing.load_args_from_checkpoint = refusing_unsafe_checkpoint_args(
        checkpointing.load_args_from_checkpoint
    )

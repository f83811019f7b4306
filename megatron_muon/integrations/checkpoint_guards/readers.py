"""The one guard: the reader Megatron will pick for a checkpoint directory, and every pickle that
reader would read, read restricted first.

Megatron-LM picks a checkpoint's reader from the directory's files, not from ``--ckpt-format``
(megatron-core 0.19.2's ``_get_checkpoint_format``): ``metadata.json`` makes it ``torch_dist``,
an ``mp_rank_0*`` entry the legacy ``torch`` format, ``.metadata`` alone ``fsdp_dtensor`` (with
``--use-megatron-fsdp``) or ``torch_dcp``. Megatron-Bridge's ``_get_checkpoint_format`` does the
same without the legacy format. ``check_reads(directory, format)`` then reads, restricted
(``checkpointing.safe_unpickle``), every pickle that reader reads:

- ``fsdp_dtensor``, ``torch_dcp``: DCP reads ``.metadata`` (``pickle.load``), each value stored
  whole (``torch.load(weights_only=False)``) and the data files ``.metadata`` references. Checked
  by ``safe_unpickle.check_pickles``: ``.metadata`` by ``MetadataUnpickler``, every value stored
  whole by torch's ``weights_only`` unpickler, every storage reference confined
  (``confined_files``).
- ``torch_dist``: the same DCP files, ``metadata.json`` (JSON) and ``common.pt`` (``torch.load``
  at torch's default, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns into
  ``weights_only=False``). Checked as above, and ``common.pt`` by ``safe_unpickle.load_pickled``
  (``weights_only=True`` passed explicitly, which no variable overrides).
- ``torch`` (legacy: each rank's ``mp_rank_*/model_optim_rng.pt`` by ``torch.load``) and
  ``--non-persistent-ckpt-type local`` (nvidia-resiliency-ext's own loader): refused by name,
  naming the directory and the format; none of their pickles is read restricted here.

``guard_megatron_load(args, load_arg, pretrained_fallback)`` resolves the directory as Megatron's
``load_checkpoint`` (``pretrained_fallback``) or ``load_args_from_checkpoint`` does
(``load_directory``; non-persistent ``global`` checkpoints as ``_load_base_checkpoint`` prefers
them), checks it, and raises on every rank the same ``UnsafeCheckpointError`` naming the file and
the global or reason (``checkpointing.ranks.agree``; without a process group, in this process:
``--use-checkpoint-args`` runs before ``torch.distributed`` is initialized). Only
``--ckpt-trust-pickles`` (``pickles.trusts_pickles``) skips it; no environment variable does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch.distributed as dist

from megatron_muon.checkpointing import safe_unpickle
from megatron_muon.checkpointing.errors import UnsafeCheckpointError
from megatron_muon.checkpointing.ranks import agree
from megatron_muon.integrations.checkpoint_guards.load_directory import (
    iteration_directory,
    megatron_load_dir,
    tracker_iteration,
)

__all__ = ["MegatronRead", "agreed", "check_reads", "guard_megatron_load", "megatron_read"]

COMMON_NAME = "common.pt"  # megatron-core's dist_checkpointing COMMON_STATE_FNAME


class MegatronRead(NamedTuple):
    """A directory and the format Megatron will read it as."""

    directory: str
    format: str


def _check_dcp(directory: str) -> None:
    safe_unpickle.check_pickles(directory)


def _check_torch_dist(directory: str) -> None:
    if os.path.lexists(os.path.join(directory, safe_unpickle.METADATA_NAME)):
        safe_unpickle.check_pickles(directory)
    if os.path.lexists(os.path.join(directory, COMMON_NAME)):
        safe_unpickle.check_saved_file(directory, COMMON_NAME)


_CHECKS: dict[str, Callable[[str], None]] = {
    "fsdp_dtensor": _check_dcp,
    "torch_dcp": _check_dcp,
    "torch_dist": _check_torch_dist,
}
_UNCHECKED = {
    "torch": "an mp_rank_* entry makes it Megatron's legacy format, each rank's "
    "model_optim_rng.pt read by torch.load",
    "non-persistent local": "--non-persistent-ckpt-type local: nvidia-resiliency-ext's local "
    "checkpoints, read by its own loader",
}


def check_reads(read: MegatronRead) -> None:
    """Every pickle ``read.format``'s reader reads in ``read.directory``, read restricted.

    Raises:
        UnsafeCheckpointError: a pickle names a global outside the allowlist, BUILDs what it did
            not create, references a file outside the directory or not a regular file (the file
            and the reason named); or the format is one not read restricted here (the directory
            and the format named).
    """
    check = _CHECKS.get(read.format)
    if check is None:
        raise UnsafeCheckpointError(
            f"{read.directory}: Megatron would read it as a {read.format!r} checkpoint "
            f"({_UNCHECKED.get(read.format, 'its files say so')}), whose pickles megatron-muon "
            "does not read restricted; refused, nothing of it was read. Loading a checkpoint from "
            "elsewhere can run any code: if you trust this one, pass --ckpt-trust-pickles"
        )
    check(read.directory)


def _megatron_format(directory: str, args: Any) -> str | None:
    """Megatron's own ``_get_checkpoint_format`` (None: no checkpoint there; Megatron raises)."""
    from megatron.training.checkpointing import _get_checkpoint_format

    if not os.path.isdir(directory):
        return None
    try:
        return str(_get_checkpoint_format(directory, args))
    except NotImplementedError:  # no checkpoint files: Megatron raises the same, reading nothing
        return None


def _non_persistent_read(load_dir: str | None, args: Any, persistent: int) -> MegatronRead | None:
    """What ``_load_base_checkpoint`` reads instead of ``load_dir``'s checkpoint of iteration
    ``persistent``: a non-persistent ``global`` one at least as recent (``torch_dist``), or
    ``local`` ones (refused by name), or nothing (None)."""
    from megatron.training.checkpointing import _NON_PERSISTENT_CKPT_SUBDIR, get_checkpoint_name

    kind = getattr(args, "non_persistent_ckpt_type", None)
    if kind is None:
        return None
    if kind != "global":
        return MegatronRead(str(load_dir), f"non-persistent {kind}")
    directory = getattr(args, "non_persistent_global_ckpt_dir", None)
    if not directory and load_dir is not None:
        directory = os.path.join(load_dir, _NON_PERSISTENT_CKPT_SUBDIR)
    named = tracker_iteration(directory) if directory else None
    if named is None or named[0] == -1 or named[0] < persistent:
        return None
    return MegatronRead(
        str(get_checkpoint_name(directory, named[0], False, return_base_dir=True)), "torch_dist"
    )


def megatron_read(args: Any, load_arg: str = "load", pretrained_fallback: bool = True) -> Any:
    """The ``MegatronRead`` a Megatron-LM load of ``getattr(args, load_arg)`` reads, or None
    where it reads no checkpoint (``load_directory``'s resolution)."""
    load_dir = megatron_load_dir(args, load_arg, pretrained_fallback)
    if load_dir is None and not pretrained_fallback:  # load_args_from_checkpoint returns early
        return None
    named = tracker_iteration(load_dir) if load_dir is not None else (-1, False)
    if named is None:  # a tracker Megatron refuses: it exits before reading a checkpoint
        return None
    iteration = args.ckpt_step if getattr(args, "ckpt_step", None) else named[0]
    non_persistent = _non_persistent_read(load_dir, args, iteration)
    if non_persistent is not None:
        return non_persistent
    directory = iteration_directory(load_dir, args)
    found = None if directory is None else _megatron_format(directory, args)
    return None if directory is None or found is None else MegatronRead(directory, found)


def agreed(check: Callable[[], None]) -> None:
    """``check()`` on every rank; an error on one is raised on every rank (``agree``; without a
    process group, here)."""
    error: BaseException | None = None
    try:
        check()
    except Exception as caught:  # noqa: BLE001 - any error on one rank must reach every rank
        error = caught
    if dist.is_initialized():
        agree(error)
    elif error is not None:
        raise error


def guard_megatron_load(
    args: Any, load_arg: str = "load", pretrained_fallback: bool = True
) -> None:
    """``check_reads`` of what a Megatron-LM load will read (module docstring); collective where
    a process group exists.

    Raises (every rank the same):
        UnsafeCheckpointError: as ``check_reads``.
    """

    def check() -> None:
        read = megatron_read(args, load_arg, pretrained_fallback)
        if read is not None:
            check_reads(read)

    agreed(check)

"""A Megatron-LM ``fsdp_dtensor`` checkpoint from elsewhere runs no code when ``--load`` reads it.

Megatron's ``load_checkpoint`` of an ``fsdp_dtensor`` checkpoint unpickles DCP's ``.metadata``
(``FileSystemReader.read_metadata``: plain ``pickle.load``) and every value DCP stored whole
(``args``, ``rng_state``, the scheduler's and param groups' values, ...: ``DefaultLoadPlanner.
load_bytes``, ``torch.load(weights_only=False)``), several times: its rank-0 read of ``args``,
its ``read_metadata`` calls, the load itself. Measured on megatron-core 0.19.2 with ``install()``
(2 CPU ranks): a ``.metadata`` replaced by a pickle whose ``__reduce__`` runs a shell command, its
SHA-256 in ``megatron_muon_files.json`` rewritten to match, ran the command at ``--load``.

``refusing_unsafe_pickles`` (applied by ``megatron_lm.install()`` to ``load_checkpoint``, inside
``checkpoint_guards.integrity``'s file check, which reads ``.metadata`` restricted too) first reads
every pickle of the checkpoint ``--load`` names with ``checkpointing.safe_unpickle``'s restricted
unpicklers on every rank (``check_pickles``) and raises the same ``UnsafeCheckpointError`` on
every rank (``agree``), naming the file and the global, before anything else reads it; then
Megatron's load runs with DCP's ``read_metadata`` and ``load_bytes`` reading restricted
(``restricted_dcp_reads``: set on torch's classes for the call, restored after), so a file
swapped after the check is refused too. Any ``--optimizer``; ``fsdp_dtensor`` only (the other
formats are Megatron's own). ``--ckpt-trust-pickles`` (``fsdp.arguments``) skips both, for a
checkpoint the user trusts whose pickles hold other types.

Not covered: ``--use-checkpoint-args`` reads ``args`` in ``initialize_megatron``, before
``load_checkpoint``, with Megatron's own reader.

Checked against megatron-core 0.19.2 (``megatron_version.SUPPORTED_MEGATRON_CORE``) and torch
2.13's ``FileSystemReader`` / ``DefaultLoadPlanner``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from megatron_muon.checkpointing import safe_unpickle
from megatron_muon.checkpointing.ranks import agree
from megatron_muon.integrations.checkpoint_guards.load_directory import checkpoint_directory

__all__ = [
    "check_checkpoint_pickles",
    "check_pickles_of",
    "refusing_unsafe_pickles",
    "restricted_dcp_reads",
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
    """Every pickle of the checkpoint ``--load`` names, read restricted. Collective (``agree``).

    Raises (every rank the same):
        UnsafeCheckpointError: a pickle names a global outside ``safe_unpickle``'s allowlist.
    """
    check_pickles_of(lambda: checkpoint_directory(args))


def check_pickles_of(find_directory: Callable[[], str | None]) -> None:
    """Every pickle of the DCP checkpoint directory ``find_directory()`` returns (None, or no
    ``.metadata`` there: nothing to check), read restricted. Collective (``agree``): an error on
    one rank, finding the directory included, is raised on every rank.

    Raises (every rank the same):
        UnsafeCheckpointError: a pickle names a global outside ``safe_unpickle``'s allowlist.
    """
    error: BaseException | None = None
    try:
        directory = find_directory()
        if directory is not None and os.path.isfile(
            os.path.join(directory, safe_unpickle.METADATA_NAME)
        ):
            safe_unpickle.check_pickles(directory)
    except Exception as caught:  # noqa: BLE001 - any error on one rank must reach every rank
        error = caught
    if dist.is_initialized():
        agree(error)
    elif error is not None:
        raise error


def refusing_unsafe_pickles(load_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``load_checkpoint`` after ``check_checkpoint_pickles``, inside
    ``restricted_dcp_reads`` (``fsdp_dtensor`` loads without ``--ckpt-trust-pickles``)."""

    @functools.wraps(load_checkpoint)
    def load_checkpoint_restricted(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        megatron = get_args()
        if (
            getattr(megatron, "ckpt_format", None) != "fsdp_dtensor"
            or not getattr(megatron, "load", None)
            or trusts_pickles(megatron)
        ):
            return load_checkpoint(*args, **kwargs)
        check_checkpoint_pickles(megatron)
        with restricted_dcp_reads():
            return load_checkpoint(*args, **kwargs)

    return load_checkpoint_restricted

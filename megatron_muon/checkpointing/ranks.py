"""Ranks in agreement: one failing rank makes every rank raise, before DCP's collectives start.

A save or load that fails on one rank while its peers enter DCP's collectives would hang them. Each
step that can fail on one rank ends in ``agree`` (one ``all_gather_object`` over the default
process group): every rank learns of the failure and raises the same error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_muon.checkpointing.errors import CheckpointError

__all__ = ["agree", "agree_on_ranks", "collective_device"]


def agree(error: BaseException | None, value: Any = None) -> list[Any]:
    """Every rank's ``value``, after every rank learned whether some rank failed. Collective.

    One ``all_gather_object`` of (error, value). If any rank failed, every rank raises: the failing
    rank its own error, the others the lowest failing rank's (same type and message, rank named).
    """
    payloads: list[Any] = [None] * dist.get_world_size()
    mine = (None if error is None else (type(error), str(error)), value)
    dist.all_gather_object(payloads, mine)
    for rank, (failure, _) in enumerate(payloads):
        if failure is None:
            continue
        if error is not None:
            raise error
        kind, message = failure
        suffix = "" if dist.get_world_size() == 1 else f" (reported by rank {rank})"
        try:
            peer_error = kind(message + suffix)
        except TypeError:  # an exception type whose constructor takes more than a message
            peer_error = CheckpointError(f"{kind.__name__}: {message}{suffix}")
        raise peer_error
    return [value for _, value in payloads]


def agree_on_ranks(error: BaseException | None, path: str, names: list[str]) -> None:
    """Every rank raises the same error unless no rank failed, all passed the same ``path`` and
    hold the same params in the same order (else DCP's collectives would fall out of step)."""
    gathered = agree(error, (path, names))
    paths = [p for p, _ in gathered]
    if len(set(paths)) > 1:
        raise CheckpointError(
            "ranks passed different checkpoint paths (every rank must pass the same directory, "
            f"on a shared file system): {dict(enumerate(paths))}"
        )
    mine = gathered[0][1]
    for rank, (_, theirs) in enumerate(gathered):
        if theirs != mine:
            position = next(
                (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                min(len(mine), len(theirs)),
            )
            on_0 = mine[position] if position < len(mine) else "nothing"
            on_r = theirs[position] if position < len(theirs) else "nothing"
            raise CheckpointError(
                f"ranks hold different params: param {position} is {on_0} on rank 0 and {on_r} "
                f"on rank {rank} ({len(mine)} and {len(theirs)} params); every rank must pass "
                "the same model and optimizer"
            )


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor for a collective over ``group`` must live (NCCL: the current GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""Owner-held optimizer state as DTensors: the whole tensor on one rank, 0 rows on the others.

A state tensor that lives whole on its matrix's owner (``sharded_soap``) is presented to
checkpointing as a DTensor on its param's mesh, placement ``Shard(0)`` on the data-parallel axis
(``Replicate`` on the others, of size 1), global shape its own, sharded unevenly: the owner's local
tensor is the whole tensor, every other rank's has 0 rows. Its chunk is therefore known locally:
the whole tensor at offset 0 on the owner, nothing elsewhere (``checkpointing.row_chunks`` gives
DCP that chunk; megatron_fsdp's uneven-DTensor preprocessing, which sums the local row counts of
the ranks before this one, computes the same). DCP then stores one global tensor per state key,
whoever owned it, and a load at another DP size fills the new owner's whole tensor and nothing
elsewhere.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["is_owner_held", "owner_held_dtensor", "whole_dtensor"]

# Attribute marking an owner-held state DTensor (on the DTensor object itself).
_MARK = "_megatron_muon_owner_held"


def owner_held_dtensor(
    local: torch.Tensor,
    param: torch.Tensor,
    axis: int,
    global_shape: tuple[int, ...],
    is_owner: bool,
) -> DTensor:
    """``local`` (the whole tensor on the owner, ``(0, *rest)`` elsewhere) as an owner-held
    DTensor on ``param``'s mesh: ``Shard(0)`` on its data-parallel mesh axis ``axis``,
    ``Replicate`` on the others (each of size 1), ``global_shape``."""
    assert isinstance(param, DTensor)
    placements = [Shard(0) if a == axis else Replicate() for a in range(param.device_mesh.ndim)]
    assert tuple(local.shape) == (tuple(global_shape) if is_owner else (0, *global_shape[1:]))
    stride = torch.empty(global_shape, device="meta").stride()
    value = DTensor.from_local(
        local,
        param.device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(global_shape),
        stride=stride,
    )
    setattr(value, _MARK, True)
    return value


def whole_dtensor(local: torch.Tensor, param: torch.Tensor) -> DTensor:
    """``local``, whole on every rank, as a DTensor laid out like ``param`` (every rank holds
    ``param`` whole: ``Replicate``, or ``Shard(0)`` over one rank). Marked like an owner-held one:
    its chunk is the whole tensor at offset 0, on every rank (DCP keeps one copy)."""
    assert isinstance(param, DTensor)
    value = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
    setattr(value, _MARK, True)
    return value


def is_owner_held(value: object) -> bool:
    """Whether ``value`` is an owner-held state DTensor (``owner_held_dtensor``)."""
    return isinstance(value, DTensor) and bool(getattr(value, _MARK, False))

"""How ``TensorParallelMuon``'s tensor parallelism meets Megatron-FSDP's row-sharded params.

With tensor parallelism, Megatron-FSDP's param is a DTensor on a ``(dp_cp, tp)`` mesh
(``layout.py``). ``ShardedMuon`` exchanges rows over the data-parallel group and hands each
tensor-parallel-local, data-parallel-full matrix to NS. Under ``tp_mode="blockwise"`` each TP rank
orthogonalizes its own block; under ``"duplicated"``/``"distributed"`` a TP-partitioned matrix
(``param.partition_dim`` set) goes through ``TensorParallelMuon.orthogonalize`` whole, which runs
collectives over ``pg_collection.tp`` (``pg_collection.expt_tp`` for experts,
``param.expert_tp``) among the TP ranks holding the same matrix. Under ``"layer_sharded"`` the
rows travel over the whole DP x TP grid instead and each unsplit matrix is orthogonalized once
(``tp_grid``); ``TensorParallelMuon`` never sees that mode (``stock_tp_mode``).

- ``tp_group``, ``needs_tp_collectives``: the TP group of a param, and whether its NS uses it.
- ``stock_tp_mode``: the tp_mode ``TensorParallelMuon`` is built with.
- ``check_param_meshes``: metadata checks, at construction, that each DTensor param's mesh agrees
  with the groups the optimizer will run collectives over; ``check_ns_method``: that the NS
  method can run under the tp_mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_muon.common.options import TpModeT
from megatron_muon.engine.layout import TensorParallelSplit, group_ranks, mesh_axes
from megatron_muon.newton_schulz.methods import NSConfig

__all__ = [
    "check_ns_method",
    "check_param_meshes",
    "needs_tp_collectives",
    "stock_tp_mode",
    "tp_group",
    "tp_size",
]


def tp_size(pg_collection: Any) -> int:
    """Ranks in ``pg_collection.tp`` (1 without a collection or a TP group)."""
    group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    return dist.get_world_size(group) if group is not None else 1


def tp_group(param: torch.Tensor, pg_collection: Any) -> dist.ProcessGroup | None:
    """The TP group ``TensorParallelMuon`` uses for ``param``: ``expt_tp`` for experts, else
    ``tp`` (None without a collection)."""
    if pg_collection is None:
        return None
    return pg_collection.expt_tp if getattr(param, "expert_tp", False) else pg_collection.tp


def stock_tp_mode(tp_mode: TpModeT) -> TpModeT:
    """What ``TensorParallelMuon`` (megatron-core's, which knows three modes) is built with:
    ``layer_sharded`` computes ``duplicated``'s update, without its ``orthogonalize``."""
    return "duplicated" if tp_mode == "layer_sharded" else tp_mode


def needs_tp_collectives(param: torch.Tensor, tp_mode: TpModeT, pg_collection: Any) -> bool:
    """True when ``TensorParallelMuon.orthogonalize`` would communicate over TP for ``param``
    (never under blockwise or layer_sharded)."""
    if tp_mode in ("blockwise", "layer_sharded"):
        return False
    partition_dim = getattr(param, "partition_dim", None)
    if partition_dim is None or partition_dim == -1:
        return False
    group = tp_group(param, pg_collection)
    return group is not None and dist.get_world_size(group) > 1


def check_ns_method(config: NSConfig, tp_mode: TpModeT, pg_collection: Any) -> None:
    """Under tensor parallelism with tp_mode duplicated/distributed, NS runs through
    ``TensorParallelMuon.orthogonalize`` across TP ranks, i.e. its own standard NS; under
    layer_sharded the same NS on the unsplit matrix, so that it is ``duplicated``'s update.

    Raises:
        ValueError: ``config`` asks for another method or custom coefficients there.
    """
    if config.is_tensor_parallel_muons or tp_mode == "blockwise" or tp_size(pg_collection) == 1:
        return
    raise ValueError(
        f"ns_method={config.ns_method!r} / custom coefficients run in megatron_muon's own NS; "
        f"tp_mode={tp_mode!r} with tensor parallelism runs TensorParallelMuon's standard "
        "NS on the unsplit matrices. Use tp_mode='blockwise' or the standard method."
    )


def check_param_meshes(
    params: Sequence[torch.Tensor],
    dp_group: dist.ProcessGroup | None,
    tp_mode: TpModeT,
    pg_collection: Any,
    names: Sequence[str | None] | None = None,
) -> None:
    """Each DTensor param's mesh matches ``dp_group`` (its rows) and, where tensor parallelism
    splits it and ``tp_mode`` communicates, the TP group of ``TensorParallelMuon``; a TP-split
    param is one ``tp_mode`` can run on. Metadata only: no collective.

    Args:
        names: each param's name, where the caller knows it (the factory), for the message.

    Raises:
        ValueError: naming the param (position, name where given, shape), its placements and
            the group that disagrees or what the mode cannot do.
    """
    dp_ranks = sorted(group_ranks(dp_group))
    for index, param in enumerate(params):
        if not isinstance(param, DTensor):
            continue
        axes = mesh_axes(param, dp_ranks)
        name = f" ({names[index]})" if names is not None and names[index] else ""
        where = (
            f"param {index}{name} of shape {tuple(param.shape)} "
            f"(placements {tuple(param.placements)})"
        )
        if sorted(axes.data_parallel_ranks) != dp_ranks:
            raise ValueError(
                f"{where} has its rows on ranks {sorted(axes.data_parallel_ranks)}, but Muon "
                f"would exchange them over dp_group = ranks {dp_ranks}; pass the group the "
                "model was wrapped with (pg_collection.dp_cp, or expt_dp for experts)"
            )
        if tp_mode != "blockwise":
            for split in axes.tensor_parallel:
                _check_tensor_parallel_split(param, split, where, tp_mode, pg_collection)


def _check_tensor_parallel_split(
    param: torch.Tensor,
    split: TensorParallelSplit,
    where: str,
    tp_mode: TpModeT,
    pg_collection: Any,
) -> None:
    """Under tp_mode duplicated/distributed, ``TensorParallelMuon.orthogonalize`` joins the
    TP blocks along ``param.partition_dim`` over ``pg_collection.tp`` (``expt_tp``): both must
    be what the DTensor's tensor-parallel axis says. Under layer_sharded the blocks join along
    ``partition_dim`` on one owner of the grid the DTensor's mesh spans (no TP group used)."""
    if param.ndim != 2:
        raise ValueError(
            f"{where} is split over tensor-parallel ranks {list(split.ranks)}: tp_mode="
            f"{tp_mode!r} on 3-D expert tensors is not supported; use 'blockwise'"
        )
    partition_dim = getattr(param, "partition_dim", None)
    if partition_dim != split.dim:
        raise ValueError(
            f"{where} is split over tensor-parallel ranks {list(split.ranks)} along dim "
            f"{split.dim}, but its partition_dim is {partition_dim}: tp_mode="
            f"{tp_mode!r} joins the TP blocks along partition_dim"
        )
    if tp_mode == "layer_sharded":
        return
    group = tp_group(param, pg_collection)
    ranks = sorted(group_ranks(group)) if group is not None else None
    if ranks != sorted(split.ranks):
        name = "expt_tp" if getattr(param, "expert_tp", False) else "tp"
        raise ValueError(
            f"{where} is split over tensor-parallel ranks {list(split.ranks)}, but tp_mode="
            f"{tp_mode!r} would run its TP collectives over pg_collection.{name} = "
            f"ranks {ranks}; pass the pg_collection the model was wrapped with"
        )

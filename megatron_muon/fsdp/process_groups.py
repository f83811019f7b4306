"""The process groups Muon uses on a Megatron-FSDP model, and how they are described.

- Rows of a dense Muon param are sharded over ``pg_collection.dp_cp``, those of an expert param
  over ``pg_collection.expt_dp``; without a ``ProcessGroupCollection`` (and without megatron-core's
  ``parallel_state``), over the data-parallel groups of the ``MegatronFSDP`` module itself.
- Tensor parallelism is ``pg_collection.tp`` (dense) and ``pg_collection.expt_tp`` (experts).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

__all__ = ["resolve_pg_collection", "row_group", "describe_groups", "strategy_name"]


def resolve_pg_collection(
    pg_collection: ProcessGroupCollection | None,
) -> ProcessGroupCollection | None:
    """``pg_collection``, else megatron-core's global groups when ``parallel_state`` is set up."""
    if pg_collection is None and parallel_state.model_parallel_is_initialized():
        return ProcessGroupCollection.use_mpu_process_groups()
    return pg_collection


def row_group(
    pg_collection: ProcessGroupCollection | None, fsdp_modules: list[Any], is_expert: bool
) -> tuple[dist.ProcessGroup, str]:
    """(group the rows are sharded over, its name for messages).

    Raises:
        ValueError: ``pg_collection`` lacks ``dp_cp`` / ``expt_dp``, or (without one) the
            ``MegatronFSDP`` module has no such data-parallel group.
    """
    name = "expt_dp" if is_expert else "dp_cp"
    if pg_collection is not None:
        group = getattr(pg_collection, name, None)
        if group is None:
            raise ValueError(
                f"the model has {'expert' if is_expert else 'dense'} Muon params but "
                f"pg_collection has no {name} group: pass a ProcessGroupCollection with {name} "
                "(megatron-core's: ProcessGroupCollection.use_mpu_process_groups())"
            )
        return group, name
    group = fsdp_modules[0].get_distributed_index().get_dp_group(is_expert_parallel=is_expert)
    if group is None:
        raise ValueError(
            f"the model has {'expert' if is_expert else 'dense'} Muon params but no {name} group "
            "is known: parallel_state is not initialized and Megatron-FSDP has no "
            f"{'expert ' if is_expert else ''}data-parallel group; pass pg_collection with {name}"
        )
    return group, f"Megatron-FSDP {'expert ' if is_expert else ''}data-parallel group"


def describe_groups(
    group: dist.ProcessGroup,
    label: str,
    pg_collection: ProcessGroupCollection | None,
    is_expert: bool,
) -> str:
    """``"dp_cp (2 ranks)"``, with ``" x tp (2 ranks)"`` where tensor parallelism is on."""
    num_ranks = dist.get_world_size(group)
    text = f"{label} ({num_ranks} {'rank' if num_ranks == 1 else 'ranks'})"
    tp_name = "expt_tp" if is_expert else "tp"
    tp_group = getattr(pg_collection, tp_name, None) if pg_collection is not None else None
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        text += f" x {tp_name} ({dist.get_world_size(tp_group)} ranks)"
    return text


def strategy_name(fsdp_modules: list[Any]) -> str:
    """The sharding strategy: e.g. ``optim_grads_params``, ``HSDP(outer no_shard, inner optim)``."""
    module = fsdp_modules[0]
    strategy = str(module.data_parallel_sharding_strategy)
    if module.get_distributed_index().use_hybrid_fsdp:
        outer = getattr(module.ddp_config, "outer_dp_sharding_strategy", "no_shard")
        strategy = f"HSDP(outer {outer}, inner {strategy})"
    return strategy

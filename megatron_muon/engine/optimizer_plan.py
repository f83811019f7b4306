"""What ``ShardedMuon.step()`` keeps between steps: its params' static plan and the runtime that
runs it, built once (layouts, one all_gather) and kept while the params are the same tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_muon.common.options import TpModeT
from megatron_muon.engine.config import MuonFsdpConfig
from megatron_muon.engine.layout import check_same_params, gather_row_layouts
from megatron_muon.engine.owner_pipeline import BucketRuntime
from megatron_muon.engine.qkv import qkv_split_shapes
from megatron_muon.engine.step_plan import NSMatrix, StepPlan, plan_step
from megatron_muon.engine.tensor_parallel import needs_tp_collectives
from megatron_muon.engine.tp_grid import GridLayouts, grid_ranks
from megatron_muon.newton_schulz.methods import NSConfig

__all__ = ["OptimizerPlan", "PlannedMuon"]


class PlannedMuon(Protocol):
    """What ``OptimizerPlan.build`` reads of the optimizer (``ShardedMuon``'s attributes)."""

    dp_group: dist.ProcessGroup | None
    split_qkv: bool
    is_qkv_fn: Callable[[torch.Tensor], bool] | None
    qkv_split_shapes: list[int] | None
    tp_mode: TpModeT
    pg_collection: Any
    ns_config: NSConfig
    fsdp_config: MuonFsdpConfig
    # Every matrix goes whole through the optimizer's own ``orthogonalize`` (NSMatrix).
    own_orthogonalize: bool


@dataclass(frozen=True, slots=True)
class OptimizerPlan:
    """What ``step()`` keeps between steps: the params it was built for, their static plan (2-D
    matrices), the positions of the 3-D expert params, and the runtime that runs the plan."""

    params: list[torch.Tensor]
    step_plan: StepPlan
    experts: list[int]
    runtime: BucketRuntime

    @staticmethod
    def build(muon: PlannedMuon, params: list[torch.Tensor]) -> OptimizerPlan:
        """Layouts (one all_gather), the static plan, and split-NS groups of ``muon``'s params.

        The plan's group is ``muon.dp_group``, or under tp_mode layer_sharded with TP-split
        params the DP x TP grid (``tp_grid``). Collective over ``muon.dp_group`` (and the grid;
        for split matrices, each split block's ranks).
        """
        fsdp = muon.fsdp_config
        # Without torch.distributed (one process) every param is whole: DP size 1.
        num_ranks = dist.get_world_size(muon.dp_group) if dist.is_initialized() else 1
        check_same_params(params, muon.dp_group)
        layouts = gather_row_layouts(params, muon.dp_group)
        group, partitions = muon.dp_group, [(1, 0)] * len(params)
        grid = grid_ranks(params, muon.dp_group) if muon.tp_mode == "layer_sharded" else None
        if grid is not None:  # the owner pool is the DP x TP grid (tp_grid)
            on_grid = GridLayouts.gather(params, muon.dp_group, layouts, grid)
            group, num_ranks, layouts = on_grid.group, on_grid.size, on_grid.layouts
            partitions = on_grid.partitions
        matrices = [
            NSMatrix(
                param=i,
                layout=layouts[i],
                qkv_split_shapes=qkv_split_shapes(
                    param, muon.split_qkv, muon.is_qkv_fn, muon.qkv_split_shapes
                ),
                tp_collectives=needs_tp_collectives(param, muon.tp_mode, muon.pg_collection),
                tp_partitions=partitions[i][0],
                tp_partition_dim=partitions[i][1],
                own_orthogonalize=muon.own_orthogonalize,
            )
            for i, param in enumerate(params)
            if param.ndim == 2
        ]
        step_plan = plan_step(
            matrices,
            num_ranks,
            muon.ns_config,
            bucket_size_bytes=fsdp.bucket_size_bytes,
            min_split_flops=fsdp.min_split_flops,
            owner_buckets=fsdp.mode == "owner",
        )
        return OptimizerPlan(
            params=params,
            step_plan=step_plan,
            experts=[i for i, p in enumerate(params) if p.ndim == 3],
            runtime=BucketRuntime(step_plan, fsdp.mode, group, num_ranks, fsdp.overlap_buckets),
        )

"""The owner-computed optimizers (``engine.owner_compute``: each matrix's state and work on one
owner rank): SOAP, REKLS and PSGDPro, built by ``fsdp.factory`` for the matrices megatron-core's
emerging-optimizer routing gives them (AdamW takes the rest).

Each is built per kind of param, dense over ``dp_cp`` and experts over ``expt_dp`` (the group
their rows are sharded over, whose ranks own the matrices), from megatron-core's
``OptimizerConfig`` (the class's ``from_optimizer_config``).
"""

from __future__ import annotations

from typing import Any

from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_muon.engine.owner_compute import OwnerComputedOptimizer
from megatron_muon.fsdp.process_groups import describe_groups, row_group
from megatron_muon.optimizers.psgd_pro import ShardedPSGDPro
from megatron_muon.optimizers.rekls import ShardedREKLS
from megatron_muon.optimizers.soap import ShardedSOAP

__all__ = ["OWNER_COMPUTED", "build_owned"]

#: registry name (``OptimizerConfig.optimizer``, ``--optimizer``) -> its adapter.
OWNER_COMPUTED: dict[str, type[OwnerComputedOptimizer]] = {
    cls.name: cls for cls in (ShardedSOAP, ShardedREKLS, ShardedPSGDPro)
}


def build_owned(
    config: Any,
    groups: list[dict],
    is_expert: bool,
    pg_collection: ProcessGroupCollection | None,
    fsdp_modules: list[Any],
) -> tuple[OwnerComputedOptimizer, str]:
    """``config.optimizer``'s class over ``groups`` (dense or expert params, rows over their
    group) and its build summary line. Collective over that group.

    Raises:
        ValueError: a setting or param the class refuses (named).
    """
    dp_group, dp_label = row_group(pg_collection, fsdp_modules, is_expert)
    optimizer = OWNER_COMPUTED[config.optimizer].from_optimizer_config(groups, config, dp_group)
    params = [p for group in groups for p in group["params"]]
    where = describe_groups(dp_group, dp_label, pg_collection, is_expert)
    kind = "expert" if is_expert else "dense"
    return optimizer, (
        f"megatron-muon {optimizer.reference_name()}[{kind}]: {len(params)} params, "
        f"{sum(p.numel() for p in params):,} elements over {where}"
    )

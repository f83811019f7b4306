"""The optimizers whose step runs on each rank's rows (``common.options.RowwiseOptimizerT``):
LaProp (elementwise), ObliqueSGD and ObliqueAdam (rows local; column sums over the row group),
built by ``fsdp.factory`` for the matrices megatron-core's emerging-optimizer routing gives them
(2-D params but embeddings and the output layer; AdamW takes the rest).

Each is built per kind of param, dense over ``dp_cp`` and experts over ``expt_dp`` (the group
their rows are sharded over, which the oblique classes' column sums reduce over), from
megatron-core's ``OptimizerConfig`` (``from_optimizer_config``: its keywords for the name, and
the ``<name>_<field>`` settings of ``optimizers.laprop`` / ``optimizers.oblique``).
"""

from __future__ import annotations

from typing import Any, get_args

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_muon.common.options import RowwiseOptimizerT
from megatron_muon.fsdp.process_groups import describe_groups, row_group, strategy_name
from megatron_muon.optimizers.laprop import LaPropConfig, ShardedLaProp
from megatron_muon.optimizers.oblique import (
    ObliqueAdamConfig,
    ObliqueSGDConfig,
    ShardedObliqueAdam,
    ShardedObliqueSGD,
)
from megatron_muon.optimizers.settings import read_settings

__all__ = ["ROWWISE_OPTIMIZERS", "ROWWISE_SETTINGS", "build_rowwise"]

#: ``RowwiseOptimizerT`` name -> its class on row shards.
ROWWISE_OPTIMIZERS: dict[str, type[ShardedLaProp | ShardedObliqueSGD | ShardedObliqueAdam]] = {
    "laprop": ShardedLaProp,
    "oblique_sgd": ShardedObliqueSGD,
    "oblique_adam": ShardedObliqueAdam,
}
#: name -> its settings beyond ``OptimizerConfig``'s fields (``--<name>-<field>`` flags).
ROWWISE_SETTINGS: dict[str, type] = {
    "laprop": LaPropConfig,
    "oblique_sgd": ObliqueSGDConfig,
    "oblique_adam": ObliqueAdamConfig,
}
assert set(ROWWISE_OPTIMIZERS) == set(ROWWISE_SETTINGS) == set(get_args(RowwiseOptimizerT))


def build_rowwise(
    config: Any,
    groups: list[dict],
    is_expert: bool,
    pg_collection: ProcessGroupCollection | None,
    fsdp_modules: list[Any],
) -> tuple[torch.optim.Optimizer, str]:
    """``config.optimizer``'s class over ``groups`` (dense or expert params, rows over their
    group) and its build summary line. Collective over that group (the oblique classes).

    Raises:
        ValueError: a setting or param the class refuses (named).
    """
    dp_group, dp_label = row_group(pg_collection, fsdp_modules, is_expert)
    optimizer_class = ROWWISE_OPTIMIZERS[config.optimizer]
    optimizer = optimizer_class.from_optimizer_config(
        groups, config, dp_group=dp_group, pg_collection=pg_collection
    )
    settings = read_settings(ROWWISE_SETTINGS[config.optimizer], config)
    params = [p for group in groups for p in group["params"]]
    where = describe_groups(dp_group, dp_label, pg_collection, is_expert)
    kind = "expert" if is_expert else "dense"
    strategy = strategy_name(fsdp_modules)
    line = (
        f"megatron-muon {optimizer_class.label}[{kind}]: {len(params)} params, "
        f"{sum(p.numel() for p in params):,} elements over {where} ({settings}), "
        f"strategy {strategy}"
    )
    return optimizer, line

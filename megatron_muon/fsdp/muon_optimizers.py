"""The orthogonalized optimizers (``ShardedMuon`` and its subclasses: Muon, adaptive Muon and the
other orthogonalized optimizers of emerging-optimizers), built by ``fsdp.factory`` for the
matrices megatron-core's emerging-optimizer routing gives them, dense over ``dp_cp`` and experts
over ``expt_dp`` (``build_orthogonalized``); ``MatrixBuild``: what every kind's builder reads
(``fsdp.optimizer_registry``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_muon.engine.config import MuonConfig, MuonFsdpConfig
from megatron_muon.engine.tensor_parallel import check_param_meshes
from megatron_muon.fsdp.process_groups import describe_groups, row_group, strategy_name
from megatron_muon.fsdp.routing import is_qkv
from megatron_muon.optimizers.adaptive_muon import ShardedAdaptiveMuon
from megatron_muon.optimizers.adaptive_muon_config import AdaptiveMuonConfig
from megatron_muon.optimizers.muon import ShardedMuon
from megatron_muon.optimizers.orthogonalized import ShardedOrthogonalized

__all__ = ["MatrixBuild", "build_orthogonalized", "count_params"]


@dataclass(frozen=True)
class MatrixBuild:
    """What a builder of the matrices' optimizer reads (one per ``build_muon_optimizer`` call).

    ``muon_config``: Muon's settings for an orthogonalized optimizer, else None;
    ``fsdp_modules``: the ``MegatronFSDP`` modules of the chunks; ``qkv_split_shapes``: the fused
    QKV's split (``fsdp.routing``)."""

    config: OptimizerConfig
    muon_config: MuonConfig | None
    fsdp_config: MuonFsdpConfig
    pg_collection: ProcessGroupCollection | None
    fsdp_modules: list[Any]
    qkv_split_shapes: list[int] | None


def count_params(groups: list[dict]) -> str:
    """``"<n> params, <m> elements"`` of the param groups (summary lines)."""
    params = [p for g in groups for p in g["params"]]
    return f"{len(params)} params, {sum(p.numel() for p in params):,} elements"


def build_orthogonalized(
    optimizer_class: type[ShardedMuon], build: MatrixBuild, groups: list[dict], is_expert: bool
) -> tuple[ShardedMuon, str]:
    """``optimizer_class`` over dense (``dp_cp``) or expert (``expt_dp``) groups, and its summary.

    Collective over that group. Raises ``ValueError`` for a param whose mesh does not match the
    group, naming the param (``ShardedMuon``'s own check knows positions and shapes only)."""
    config, muon_config = build.config, build.muon_config
    assert muon_config is not None, "the registry gives an orthogonalized optimizer Muon's config"
    dp_group, dp_label = row_group(build.pg_collection, build.fsdp_modules, is_expert)
    params = [p for group in groups for p in group["params"]]
    names = {id(p): n for module in build.fsdp_modules for n, p in module.named_parameters()}
    tp_mode = muon_config.tp_mode
    check_param_meshes(
        params, dp_group, tp_mode, build.pg_collection, [names.get(id(p)) for p in params]
    )
    common: dict[str, Any] = dict(
        fsdp=build.fsdp_config, dp_group=dp_group, pg_collection=build.pg_collection
    )
    if issubclass(optimizer_class, ShardedOrthogonalized):  # its own settings from ``config``
        muon: ShardedMuon = optimizer_class.from_optimizer_config(groups, config, **common)
    else:
        # The matrix optimizer's own settings beyond Muon's, from ``OptimizerConfig``.
        extra: dict[str, Any] = {}
        if issubclass(optimizer_class, ShardedAdaptiveMuon):
            extra["adaptive"] = AdaptiveMuonConfig.from_optimizer_config(config)
        muon = optimizer_class(
            groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            muon=muon_config,
            is_qkv_fn=is_qkv,
            qkv_split_shapes=build.qkv_split_shapes,
            **common,
            **extra,
        )
    kind = "expert" if is_expert else "dense"
    name = "Muon"
    if isinstance(muon, ShardedAdaptiveMuon):
        name = f"AdaptiveMuon({muon.moment2_method})"
    name = type(muon.reference).__name__ if isinstance(muon, ShardedOrthogonalized) else name
    line = (
        f"megatron-muon {name}[{kind}]: {count_params(groups)} over "
        f"{describe_groups(dp_group, dp_label, build.pg_collection, is_expert)}, "
        f"strategy {strategy_name(build.fsdp_modules)}, mode {build.fsdp_config.mode}, "
        f"tp_mode {muon_config.tp_mode}"
    )
    return muon, line

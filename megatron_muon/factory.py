"""``build_muon_optimizer``: Muon + AdamW (or Lion) for model chunks wrapped by Megatron-FSDP.

What a Megatron user calls in place of ``get_megatron_optimizer`` when ``optimizer="muon"`` meets
Megatron-FSDP (alias ``get_megatron_muon_optimizer``, same signature). It returns an
``FsdpStepWrapper`` around an ``FsdpChainedOptimizer`` of ``FP32Optimizer``-wrapped sub-optimizers:

- ``ShardedMuon`` for dense matrices, rows sharded over ``pg_collection.dp_cp``;
- ``ShardedMuon`` for expert matrices, over ``pg_collection.expt_dp``;
- AdamW (``muon_scalar_optimizer="adam"``) or Lion for everything else.

Which param goes to which optimizer is ``megatron_muon.routing``'s (megatron-core's rules, plus the
learned position embedding to the scalar optimizer). Param groups (weight-decay and lr
multipliers, decoupled lr) come from megatron-core's ``_get_param_groups`` with
``get_standard_config_overrides`` when ``config_overrides`` is None.

Megatron-FSDP optimizer params are always fp32-or-wider main weights (the FSDP mixed-precision
policy keeps compute weights in bf16 apart), so every sub-optimizer is an ``FP32Optimizer`` also
under ``bf16``; Megatron's ``Float16OptimizerWithFloat16Params`` needs a ``main_grad`` that FSDP's
DTensor main params do not have (megatron-core 0.19.2 crashes there with bf16). Optimizer state
is created at build time for every param on every rank, without a step: Megatron-FSDP's
``fsdp_dtensor`` checkpointing runs collectives per state tensor, so state keys must not depend on
which rank holds rows, and a zero-grad step would apply weight decay.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import (
    _get_megatron_optimizer_based_on_param_groups,
    _get_param_groups,
)
from megatron.core.optimizer.emerging_optimizers import _eopt_init_state_fn
from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig, ParamKey
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_muon.chained_optimizer import FsdpChainedOptimizer
from megatron_muon.config import MuonConfig, MuonFsdpConfig
from megatron_muon.console import print_rank_0
from megatron_muon.megatron_fsdp_compat import unwrap_megatron_fsdp
from megatron_muon.qk_clip import QKClip, find_self_attentions
from megatron_muon.routing import RoutedParam, is_qkv, route_params, split_groups
from megatron_muon.sharded_muon import ShardedMuon
from megatron_muon.step_wrapper import FsdpStepWrapper

__all__ = ["build_muon_optimizer", "get_megatron_muon_optimizer", "RoutedParam"]

# Optimizer names this factory builds (``OptimizerConfig.optimizer``) -> the matrix optimizer.
_MUON_OPTIMIZERS: dict[str, type] = {"muon": ShardedMuon}
# ``OptimizerConfig.muon_scalar_optimizer`` -> display name (megatron-core builds the optimizer).
_SCALAR_OPTIMIZERS: dict[str, str] = {"adam": "AdamW", "lion": "Lion"}

# --------------------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------------------


def build_muon_optimizer(
    config: OptimizerConfig,
    model_chunks: Sequence[torch.nn.Module] | torch.nn.Module,
    config_overrides: dict[ParamKey, Any] | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    *,
    fsdp_config: MuonFsdpConfig | None = None,
    grads_already_synced: bool = False,
) -> FsdpStepWrapper:
    """Builds exact Muon (+ AdamW/Lion) for model chunks wrapped by Megatron-FSDP. Collective.

    Args:
        config: megatron-core ``OptimizerConfig`` with ``optimizer="muon"``: its ``muon_*`` fields,
            lr / min_lr / decoupled_lr, weight_decay, adam betas/eps or lion betas, clip_grad,
            bf16 (fp16 is refused), log_num_zeros_in_grad.
        model_chunks: megatron-core ``FullyShardedDataParallel`` or ``MegatronFSDP`` modules (either
            copy of the class), built right after wrapping: their params must be Megatron-FSDP's
            optimizer params (DTensors), not the compute weights swapped in during forward.
        config_overrides: per-param overrides as in ``get_megatron_optimizer`` (None:
            megatron-core's standard ones: no weight decay on biases and 1-D params, decoupled lr).
        pg_collection: process groups; dense Muon rows are sharded over ``dp_cp``, expert Muon rows
            over ``expt_dp``, TP groups ``tp``/``expt_tp``. None: megatron-core's global groups when
            ``parallel_state`` is initialized, else the groups the ``MegatronFSDP`` modules use.
        fsdp_config: megatron-muon's owner/gather mode and friends (default ``MuonFsdpConfig()``).
            With ``qk_clip_threshold`` set, a ``QKClip`` over every megatron-core
            ``SelfAttention`` in the chunks is built here, on the optimizer params (before any
            forward swaps the compute weights in), and the wrapper runs it after each step.
        grads_already_synced: True inside Megatron-LM's training loop (``finalize_model_grads``
            already called ``finish_grad_sync``); False for a custom loop (see ``FsdpStepWrapper``).

    Returns:
        ``FsdpStepWrapper`` around an ``FsdpChainedOptimizer``; ``.routing`` lists where each param
        went and ``.summary_lines`` the lines printed (rank 0) at build time.

    Raises:
        ValueError: unknown optimizer name, fp16, a Muon param that is not a matrix, params that
            are not Megatron-FSDP optimizer params, missing ``expt_dp`` for a model with experts,
            a process group that does not match the ranks a param is sharded over.
        TypeError: a model chunk not wrapped by Megatron-FSDP.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    _check_config(config)
    fsdp_modules = _fsdp_modules(chunks)
    muon_config = MuonConfig.from_optimizer_config(config)
    fsdp_config = fsdp_config or MuonFsdpConfig()
    if pg_collection is None and parallel_state.model_parallel_is_initialized():
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()

    scalar_name = muon_config.scalar_optimizer
    routing = route_params(chunks, config, config_overrides, scalar_name)

    param_groups = _get_param_groups(chunks, config, routing.overrides)
    _set_initial_lr_and_weight_decay(param_groups, config)
    by_target = split_groups(param_groups, scalar_name)

    optimizers: list[MegatronOptimizer] = []
    summary: list[str] = []
    strategy = _strategy(fsdp_modules)
    for is_expert in (False, True):
        groups = by_target.get(("muon", is_expert))
        if groups:
            muon, line = _muon_optimizer(
                config,
                muon_config,
                groups,
                is_expert,
                pg_collection,
                fsdp_modules,
                routing.qkv_split_shapes,
                fsdp_config,
            )
            optimizers.append(muon)
            summary.append(
                f"{line}, strategy {strategy}, mode {fsdp_config.mode}, "
                f"tp_mode {muon_config.tp_mode}"
            )
    scalar_groups = by_target.get((scalar_name, False), []) + by_target.get((scalar_name, True), [])
    if scalar_groups:
        scalar, init_state_fn = _scalar_optimizer(config, chunks, scalar_groups, scalar_name)
        optimizers.append(_wrap(scalar, config, init_state_fn, pg_collection))
        summary.append(
            f"megatron-muon {_SCALAR_OPTIMIZERS[scalar_name]}: {_count(scalar_groups)}, "
            f"strategy {strategy}"
        )
    for line in summary:  # rank 0, at any logging level: which optimizer took which weights
        print_rank_0(line)

    qk_clip = _qk_clip(fsdp_config, chunks, pg_collection, fsdp_modules)
    if qk_clip is not None:
        summary.append(
            f"megatron-muon QK-clip: threshold {qk_clip.threshold:g} on "
            f"{len(qk_clip.attentions)} attention layers"
        )
        print_rank_0(summary[-1])

    chained = FsdpChainedOptimizer(optimizers)
    wrapper = FsdpStepWrapper(
        chained, fsdp_modules, grads_already_synced=grads_already_synced, qk_clip=qk_clip
    )
    wrapper.routing = routing.params
    wrapper.summary_lines = summary
    return wrapper


#: The name Megatron-LM gives the same job (``get_megatron_optimizer``'s signature and role).
get_megatron_muon_optimizer = build_muon_optimizer


# --------------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------------


def _check_config(config: OptimizerConfig) -> None:
    if config.optimizer not in _MUON_OPTIMIZERS:
        raise ValueError(
            f"megatron-muon builds optimizer(s) {sorted(_MUON_OPTIMIZERS)} for Megatron-FSDP, got "
            f"optimizer={config.optimizer!r}; use megatron.core.optimizer.get_megatron_optimizer "
            "for other optimizers"
        )
    if config.muon_scalar_optimizer not in _SCALAR_OPTIMIZERS:
        raise ValueError(
            f"muon_scalar_optimizer must be one of {sorted(_SCALAR_OPTIMIZERS)}, got "
            f"{config.muon_scalar_optimizer!r}"
        )
    if config.fp16:
        raise ValueError(
            "Muon with fp16 is not supported (as in megatron-core): loss scaling and fp16 master "
            "weights do not apply to Megatron-FSDP's fp32 main params. Use bf16 or fp32."
        )
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr must be set")


def _fsdp_modules(chunks: list[torch.nn.Module]) -> list[Any]:
    modules = []
    for index, chunk in enumerate(chunks):
        module = unwrap_megatron_fsdp(chunk)
        if module is None:
            raise TypeError(
                f"model chunk {index} ({type(chunk).__name__}) is not wrapped by Megatron-FSDP: "
                "build_muon_optimizer takes megatron.core.distributed.FullyShardedDataParallel or "
                "a MegatronFSDP (megatron_fsdp.fully_shard_model); for DDP or unwrapped models use "
                "megatron.core.optimizer.get_megatron_optimizer"
            )
        modules.append(module)
    return modules


# --------------------------------------------------------------------------------------------------
# param groups
# --------------------------------------------------------------------------------------------------


def _set_initial_lr_and_weight_decay(param_groups: list[dict], config: OptimizerConfig) -> None:
    """What ``OptimizerParamScheduler`` sets at a constant schedule: ``lr = max_lr``,
    ``weight_decay = config.weight_decay * wd_mult``, so a loop without a scheduler also
    leaves biases and norms undecayed. A scheduler overwrites both every step."""
    for group in param_groups:
        group["lr"] = group.get("max_lr") if group.get("max_lr") is not None else config.lr
        group["weight_decay"] = config.weight_decay * group.get("wd_mult", 1.0)


# --------------------------------------------------------------------------------------------------
# process groups
# --------------------------------------------------------------------------------------------------


def _dp_group(
    pg_collection: ProcessGroupCollection | None, fsdp_modules: list[Any], is_expert: bool
) -> tuple[dist.ProcessGroup, str]:
    """(group the rows are sharded over, its name for messages)."""
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


# --------------------------------------------------------------------------------------------------
# sub-optimizers
# --------------------------------------------------------------------------------------------------


def _muon_optimizer(
    config: OptimizerConfig,
    muon_config: MuonConfig,
    groups: list[dict],
    is_expert: bool,
    pg_collection: ProcessGroupCollection | None,
    fsdp_modules: list[Any],
    qkv_split_shapes: list[int] | None,
    fsdp_config: MuonFsdpConfig,
) -> tuple[FP32Optimizer, str]:
    """``ShardedMuon`` over dense (``dp_cp``) or expert (``expt_dp``) groups, and its summary."""
    dp_group, dp_label = _dp_group(pg_collection, fsdp_modules, is_expert)
    muon = _MUON_OPTIMIZERS[config.optimizer](
        groups,
        lr=config.lr,
        weight_decay=config.weight_decay,
        is_qkv_fn=is_qkv,
        qkv_split_shapes=qkv_split_shapes,
        pg_collection=pg_collection,
        dp_group=dp_group,
        **muon_config.tensor_parallel_muon_kwargs(),
        **fsdp_config.sharded_muon_kwargs(),
    )
    kind = "expert" if is_expert else "dense"
    num_ranks = dist.get_world_size(dp_group)
    line = (
        f"megatron-muon Muon[{kind}]: {_count(groups)} over {dp_label} "
        f"({num_ranks} {'rank' if num_ranks == 1 else 'ranks'})"
    )
    tp_name = "expt_tp" if is_expert else "tp"
    tp_group = getattr(pg_collection, tp_name, None) if pg_collection is not None else None
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        line += f" x {tp_name} ({dist.get_world_size(tp_group)} ranks)"
    return _wrap(muon, config, _eopt_init_state_fn, pg_collection), line


def _qk_clip(
    fsdp_config: MuonFsdpConfig,
    chunks: list[torch.nn.Module],
    pg_collection: ProcessGroupCollection | None,
    fsdp_modules: list[Any],
) -> QKClip | None:
    """MuonClip's ``QKClip`` when ``fsdp_config.qk_clip_threshold`` is set, else None.

    Built now, while every ``linear_qkv`` weight (and bias) is the DTensor row shard the optimizer
    updates (a forward swaps in the compute weights); max logits are all-reduced over the dense
    data-parallel group (``dp_cp``), whose ranks see different tokens.
    """
    if fsdp_config.qk_clip_threshold is None:
        return None
    attentions = find_self_attentions(chunks)
    if not attentions:
        raise ValueError(
            f"qk_clip_threshold={fsdp_config.qk_clip_threshold} but the model has no megatron-core "
            "SelfAttention layer to clip"
        )
    group, _ = _dp_group(pg_collection, fsdp_modules, is_expert=False)
    return QKClip(attentions, fsdp_config.qk_clip_threshold, group=group)


def _scalar_optimizer(
    config: OptimizerConfig, chunks: list[torch.nn.Module], groups: list[dict], name: str
) -> tuple[torch.optim.Optimizer, Callable]:
    """megatron-core's AdamW / Lion over ``groups``, with state created for every param now."""
    scalar_config = copy.copy(config)
    scalar_config.optimizer = name
    scalar_config.use_distributed_optimizer = False
    optimizer, init_state_fn = _get_megatron_optimizer_based_on_param_groups(
        config=scalar_config,
        model_chunks=chunks,
        param_groups=groups,
        skip_megatron_wrapping=True,
    )
    _init_state_eagerly(optimizer, init_state_fn, config)
    return optimizer, init_state_fn


def _init_state_eagerly(optimizer: torch.optim.Optimizer, init_state_fn: Callable, config) -> None:
    """Every param's optimizer state, as the optimizer would create it lazily, without a step.

    Rank-symmetric state: a rank holding no rows of a param has ``grad is None`` and torch creates
    no state for it, and Megatron-FSDP's fsdp_dtensor checkpointing then deadlocks (REFERENCE.md
    section 8). A zero-grad "dummy" step would create it but apply weight decay (section 5).
    """
    if isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        for group in optimizer.param_groups:
            capturable_or_fused = group.get("capturable") or group.get("fused")
            for param in group["params"]:
                state = optimizer.state[param]
                if state:
                    continue
                state["step"] = (
                    torch.zeros((), dtype=torch.float32, device=param.device)
                    if capturable_or_fused
                    else torch.tensor(0.0, dtype=torch.float32)
                )
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format
                    )
    elif hasattr(optimizer, "_init_group"):
        # emerging_optimizers (Lion): its own lazy init, for params without grads too.
        for group in optimizer.param_groups:
            optimizer._init_group(group, skip_non_grad_params=False)
    else:
        # Fused Adam (Transformer Engine / Apex): megatron-core's own checkpoint-load init.
        init_state_fn(optimizer, config)


def _wrap(
    optimizer: torch.optim.Optimizer,
    config: OptimizerConfig,
    init_state_fn: Callable,
    pg_collection: ProcessGroupCollection | None,
) -> FP32Optimizer:
    """``FP32Optimizer`` (shared ``config`` object, as ``ChainedOptimizer`` requires)."""
    wrapped = FP32Optimizer(optimizer, config, init_state_fn)
    tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    wrapped.tp_group = tp_group
    wrapped.expert_tp_group = (
        getattr(pg_collection, "expt_tp", tp_group) if pg_collection is not None else None
    )
    return wrapped


# --------------------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------------------


def _count(groups: list[dict]) -> str:
    params = [p for g in groups for p in g["params"]]
    return f"{len(params)} params, {sum(p.numel() for p in params):,} elements"


def _strategy(fsdp_modules: list[Any]) -> str:
    module = fsdp_modules[0]
    strategy = str(module.data_parallel_sharding_strategy)
    if module.get_distributed_index().use_hybrid_fsdp:
        outer = getattr(module.ddp_config, "outer_dp_sharding_strategy", "no_shard")
        strategy = f"HSDP(outer {outer}, inner {strategy})"
    return strategy

"""``build_muon_optimizer``: Muon or another emerging optimizer (+ AdamW/Lion) for Megatron-FSDP.

What a Megatron user calls in place of ``get_megatron_optimizer`` when ``optimizer="muon"`` (or
``"lion"``, the values of ``common.options.FsdpOptimizerT``, or another orthogonalized optimizer
of emerging-optimizers, ``OrthogonalizedOptimizerT``) meets Megatron-FSDP (alias
``get_megatron_muon_optimizer``, same signature). It returns the final optimizer: an
``FsdpStepWrapper`` (or, for Megatron-LM's ``fsdp_dtensor`` checkpoints, its subclass
``MegatronCheckpointedOptimizer``) with the routing, the build summary and QK-clip, around an
``FsdpChainedOptimizer`` of ``FP32Optimizer``-wrapped sub-optimizers:

- ``ShardedMuon`` (or a subclass) for dense matrices, rows sharded over ``pg_collection.dp_cp``;
- ``ShardedMuon`` for expert matrices, over ``pg_collection.expt_dp``;
- AdamW (``muon_scalar_optimizer="adam"``) or Lion for everything else;

or, for ``optimizer="lion"``, as megatron-core routes ``--optimizer lion``: its Lion
(``lion_beta1``/``lion_beta2``) for the matrices Muon would take, AdamW for the rest. Lion's
update is elementwise, so it runs on each rank's row shards as they are (a rank holding no rows
of a param steps nothing there; its state exists all the same). ``optimizer="soap"``:
``ShardedSOAP`` (each matrix's state and work on one owner rank) for those matrices, AdamW for
the rest; ``"rekls"``, ``"psgd_pro"`` likewise (``fsdp.owner_computed_optimizers``);
``optimizer="sgd"``: megatron-core's SGD for every param (its ``DistributedOptimizer`` refuses
SGD with Megatron-FSDP). Each name's kind, builder and scalar optimizer are its entry in
``fsdp.optimizer_registry.OPTIMIZERS``: the factory looks it up and wraps what it builds.

Which param goes to which optimizer is ``megatron_muon.fsdp.routing``'s (megatron-core's rules,
plus the
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

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from megatron.core.optimizer.emerging_optimizers import _eopt_init_state_fn
from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig, ParamKey
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_muon.common.console import print_rank_0
from megatron_muon.common.megatron_fsdp_compat import megatron_fsdp_modules
from megatron_muon.engine.config import MuonFsdpConfig
from megatron_muon.fsdp.chained_optimizer import FsdpChainedOptimizer
from megatron_muon.fsdp.checkpointed_optimizer import MegatronCheckpointedOptimizer
from megatron_muon.fsdp.elementwise_optimizers import megatron_core_optimizer
from megatron_muon.fsdp.muon_optimizers import MatrixBuild, count_params
from megatron_muon.fsdp.optimizer_registry import OPTIMIZERS, OptimizerEntry, fsdp_optimizer_names
from megatron_muon.fsdp.process_groups import resolve_pg_collection, strategy_name
from megatron_muon.fsdp.qk_clip import QKClipConfig, build_qk_clip
from megatron_muon.fsdp.routing import (
    RoutedParam,
    Routing,
    param_groups_by_optimizer,
    route_params,
)
from megatron_muon.fsdp.step_wrapper import FsdpStepWrapper

__all__ = ["build_muon_optimizer", "get_megatron_muon_optimizer", "RoutedParam", "CkptFormatT"]

#: ``build_muon_optimizer(ckpt_format=...)``: the checkpoint format of the optimizer's state.
CkptFormatT = Literal["fsdp_dtensor"]

# ``MuonConfig.scalar_optimizer`` (checked there) -> display name (megatron-core builds it).
_SCALAR_OPTIMIZER_NAMES: dict[str, str] = {"adam": "AdamW", "lion": "Lion", "sgd": "SGD"}
# ``ckpt_format`` -> the step wrapper class (their docstrings say how each checkpoints).
_STEP_WRAPPERS: dict[CkptFormatT | None, type[FsdpStepWrapper]] = {
    None: FsdpStepWrapper,
    "fsdp_dtensor": MegatronCheckpointedOptimizer,
}

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
    qk_clip: QKClipConfig | None = None,
    grads_already_synced: bool = False,
    ckpt_format: CkptFormatT | None = None,
    stop_on_nonfinite_grad_norm: bool | None = None,
) -> FsdpStepWrapper:
    """Builds exact Muon (+ AdamW/Lion), or Lion, for model chunks wrapped by Megatron-FSDP.

    Collective.

    Args:
        config: megatron-core ``OptimizerConfig`` with ``optimizer="muon"`` (its ``muon_*``
            fields), ``"adaptive_muon"``, ``"lion"``, an ``OrthogonalizedOptimizerT`` name; lr,
            min_lr, decoupled_lr, weight_decay, adam betas/eps or lion betas, clip_grad, bf16
            (fp16 is refused), log_num_zeros_in_grad.
        model_chunks: megatron-core ``FullyShardedDataParallel`` or ``MegatronFSDP`` modules (either
            copy of the class), built right after wrapping: their params must be Megatron-FSDP's
            optimizer params (DTensors), not the compute weights swapped in during forward.
        config_overrides: per-param overrides as in ``get_megatron_optimizer`` (None:
            megatron-core's standard ones: no weight decay on biases and 1-D params, decoupled lr).
        pg_collection: process groups; dense Muon rows are sharded over ``dp_cp``, expert Muon rows
            over ``expt_dp``, TP groups ``tp``/``expt_tp``. None: megatron-core's global groups when
            ``parallel_state`` is initialized, else the groups the ``MegatronFSDP`` modules use.
        fsdp_config: megatron-muon's owner/gather mode and friends (default ``MuonFsdpConfig()``).
        qk_clip: MuonClip (None: off). A ``QKClip`` over every megatron-core ``SelfAttention``
            and ``MultiLatentAttention`` in the chunks is built here, on the optimizer params
            (before any forward swaps the compute weights in), and the wrapper runs it after each
            step.
        grads_already_synced: True inside Megatron-LM's training loop (``finalize_model_grads``
            already called ``finish_grad_sync``); False for a custom loop (see ``FsdpStepWrapper``).
        ckpt_format: None: an ``FsdpStepWrapper``, checkpointed with
            ``megatron_muon.save_checkpoint`` / ``load_checkpoint``; ``"fsdp_dtensor"``: a
            ``MegatronCheckpointedOptimizer``, whose state goes into Megatron-LM's own
            ``save_checkpoint`` / ``load_checkpoint`` with ``--ckpt-format fsdp_dtensor``.
        stop_on_nonfinite_grad_norm: with ``ckpt_format="fsdp_dtensor"``: raise after a step
            skipped for a NaN or Inf grad norm, as Megatron's ``--check-for-nan-in-loss-and-grad``
            stops (None: True, Megatron's default). Only with ``ckpt_format="fsdp_dtensor"``; the
            ``FsdpStepWrapper`` reports a skipped step with ``update_successful=False``.

    Returns:
        The step wrapper (``FsdpStepWrapper`` or ``MegatronCheckpointedOptimizer``) around an
        ``FsdpChainedOptimizer``; ``.routing`` lists where each param went and
        ``.summary_lines`` the lines printed (rank 0) at build time.

    Raises:
        ValueError: unknown optimizer name or ``ckpt_format``, fp16, a ``muon_*`` value that
            ``MuonConfig`` refuses (e.g. ``muon_scalar_optimizer``), a Muon param that is not a
            matrix, params that are not Megatron-FSDP optimizer params, missing ``expt_dp`` for
            a model with experts, a process group that does not match the ranks a param is
            sharded over, ``stop_on_nonfinite_grad_norm`` without ``ckpt_format="fsdp_dtensor"``.
        TypeError: a model chunk not wrapped by Megatron-FSDP.
    """
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    _check_config(config)
    _check_step_wrapper_options(ckpt_format, stop_on_nonfinite_grad_norm)
    fsdp_modules = megatron_fsdp_modules(chunks)
    entry = OPTIMIZERS[config.optimizer]
    # Muon's flags are read (and checked) only where Muon is built; ShardedOrthogonalized reads
    # its class's own settings from ``config``; Lion and SOAP take none of Muon's.
    muon_config = entry.muon_config(config)
    fsdp_config = fsdp_config or MuonFsdpConfig()
    pg_collection = resolve_pg_collection(pg_collection)
    # The rest: muon_scalar_optimizer beside Muon; Adam beside another emerging optimizer, as
    # megatron-core's default emerging-optimizer entry routes it (SGD: SGD, all params).
    scalar_name = (
        muon_config.scalar_optimizer if muon_config is not None else entry.scalar_optimizer
    )
    routing = route_params(chunks, config, config_overrides, scalar_name, config.optimizer)
    build = MatrixBuild(
        config, muon_config, fsdp_config, pg_collection, fsdp_modules, routing.qkv_split_shapes
    )
    optimizers, summary = _sub_optimizers(entry, build, routing, chunks)
    for line in summary:  # rank 0, at any logging level: which optimizer took which weights
        print_rank_0(line)
    for difference in routing.differences:  # where megatron-core's own optimizer routes otherwise
        print_rank_0(difference.log_line())

    clip = build_qk_clip(qk_clip, chunks, pg_collection, fsdp_modules)
    if clip is not None:
        summary.append(
            f"megatron-muon QK-clip: threshold {clip.threshold:g} on "
            f"{len(clip.attentions)} attention layers"
        )
        print_rank_0(summary[-1])

    options: dict[str, Any] = {}
    if ckpt_format == "fsdp_dtensor":
        stop = True if stop_on_nonfinite_grad_norm is None else stop_on_nonfinite_grad_norm
        options = {"model_chunks": chunks, "stop_on_nonfinite_grad_norm": stop}
    return _STEP_WRAPPERS[ckpt_format](
        FsdpChainedOptimizer(optimizers),
        fsdp_modules,
        grads_already_synced=grads_already_synced,
        qk_clip=clip,
        routing=routing.params,
        summary_lines=summary,
        **options,
    )


#: The name Megatron-LM gives the same job (``get_megatron_optimizer``'s signature and role).
get_megatron_muon_optimizer = build_muon_optimizer


# --------------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------------


def _check_config(config: OptimizerConfig) -> None:
    entry = OPTIMIZERS.get(config.optimizer)
    if entry is None or entry.kind == "megatron_core":
        raise ValueError(
            f"megatron-muon builds optimizer(s) {list(fsdp_optimizer_names())} for Megatron-FSDP, "
            f"got optimizer={config.optimizer!r}; use "
            "megatron.core.optimizer.get_megatron_optimizer for other optimizers"
        )
    if config.fp16:
        raise ValueError(
            f"{config.optimizer} with fp16 is not supported (as in megatron-core's emerging "
            "optimizers): loss scaling and fp16 master weights do not apply to Megatron-FSDP's "
            "fp32 main params. Use bf16 or fp32."
        )
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr must be set")


def _check_step_wrapper_options(
    ckpt_format: CkptFormatT | None, stop_on_nonfinite_grad_norm: bool | None
) -> None:
    if ckpt_format not in _STEP_WRAPPERS:
        raise ValueError(
            f"ckpt_format must be one of {sorted(k for k in _STEP_WRAPPERS if k)} or None, got "
            f"{ckpt_format!r}"
        )
    if stop_on_nonfinite_grad_norm is not None and ckpt_format != "fsdp_dtensor":
        raise ValueError(
            "stop_on_nonfinite_grad_norm applies to the optimizer of Megatron-LM's loop "
            "(ckpt_format='fsdp_dtensor'); the FsdpStepWrapper reports a skipped step with "
            "update_successful=False"
        )


# --------------------------------------------------------------------------------------------------
# sub-optimizers
# --------------------------------------------------------------------------------------------------


def _sub_optimizers(
    entry: OptimizerEntry, build: MatrixBuild, routing: Routing, chunks: list[torch.nn.Module]
) -> tuple[list[MegatronOptimizer], list[str]]:
    """The matrices' optimizer (dense and expert apart: ``entry.builder``) and the scalar
    optimizer (those with params), each ``FP32Optimizer``-wrapped, and their summaries.

    ``entry.builder`` None (elementwise, Lion): megatron-core's own class over the dense and
    expert matrices' row shards together, as the scalar optimizer is built.
    """
    config, pg_collection = build.config, build.pg_collection
    by_target = param_groups_by_optimizer(chunks, config, routing)
    optimizers: list[MegatronOptimizer] = []
    summary: list[str] = []
    names = [routing.scalar_optimizer]
    if entry.builder is None and routing.matrix_optimizer != routing.scalar_optimizer:
        names.insert(0, routing.matrix_optimizer)
    for is_expert in (False, True):
        groups = by_target.get((routing.matrix_optimizer, is_expert))
        if groups and entry.builder is not None:
            matrices, line = entry.builder(build, groups, is_expert)
            optimizers.append(_wrap(matrices, config, _eopt_init_state_fn, pg_collection))
            summary.append(line)
    strategy = strategy_name(build.fsdp_modules)
    for name in names:
        groups = by_target.get((name, False), []) + by_target.get((name, True), [])
        if groups:
            optimizer, init_state_fn = megatron_core_optimizer(config, chunks, groups, name)
            optimizers.append(_wrap(optimizer, config, init_state_fn, pg_collection))
            summary.append(
                f"megatron-muon {_SCALAR_OPTIMIZER_NAMES[name]}: {count_params(groups)}, "
                f"strategy {strategy}"
            )
    return optimizers, summary


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

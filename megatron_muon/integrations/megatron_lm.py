"""``--optimizer muon --use-megatron-fsdp`` in Megatron-LM's own training loop: one ``install()``.

Megatron-LM's ``pretrain_gpt.py`` trains through ``megatron.training.pretrain``, which ships inside
the megatron-core wheel. Put ``install()`` at the top of that script (before it parses arguments)
and ``--optimizer muon`` works together with ``--use-megatron-fsdp --ckpt-format fsdp_dtensor``, for
every ``--data-parallel-sharding-strategy`` and HSDP (``--num-distributed-optimizer-instances``).

What ``install()`` patches, and why (three functions, each wrapped, none copied):

1. ``megatron.training.arguments.parse_args``: our flags (``megatron_muon.arguments.add_muon_args``:
   ``--muon-fsdp-mode`` and the rest) are chained after the caller's ``extra_args_provider``, so
   a script that passes its own provider, or none, gets them without a second edit.
2. ``megatron.training.arguments.validate_args``: megatron-core 0.19.2 refuses Muon with
   Megatron-FSDP twice (``assert args.optimizer in ('sgd', 'adam')`` in the Megatron-FSDP block;
   ``assert not args.use_megatron_fsdp`` in the emerging-optimizer block, which also allows only the
   torch/torch_dist checkpoint formats while Megatron-FSDP requires fsdp_dtensor). Exactly when
   ``args.optimizer == "muon"`` and ``args.use_megatron_fsdp``, the original runs with the
   optimizer reported as "adam" and the name is restored before the arguments are printed and
   returned (``--fp16`` is refused there, as the factory does). In 0.19.2 ``validate_args``
   reads ``args.optimizer`` only at those two places, so
   every other check runs unchanged; skipping the emerging-optimizer block also keeps
   ``use_layer_wise_distributed_optimizer`` off (that optimizer shards whole params over DP, which
   Megatron-FSDP already does by rows).
   ``--qk-clip`` is taken over there too: megatron-muon's ``QKClip`` clips the main weights'
   row shards with Megatron's ``--qk-clip-threshold``, Megatron's own ``clip_qk`` (on the
   compute weights, TE only) does not run (``_take_over_qk_clip``).
   HSDP (``--num-distributed-optimizer-instances`` > 1) turns ``--overlap-grad-reduce`` on, with
   a warning (``_reduce_grads_across_hsdp_replicas``): without it megatron-core 0.19.2's
   Megatron-FSDP never reduces gradients across the HSDP replicas.
3. ``get_megatron_optimizer`` as ``megatron.training.training`` imported it (the name
   ``setup_model_and_optimizer`` calls; ``megatron.core.optimizer.get_megatron_optimizer`` itself is
   left alone): exactly when ``config.optimizer == "muon"`` and a model chunk is wrapped by
   Megatron-FSDP, it returns megatron-muon's optimizer (``megatron_muon.build_muon_optimizer``:
   exact Muon on FSDP shards behind a step wrapper that installs the weights and re-syncs params;
   inside this loop gradients were already reduced by ``finalize_model_grads``, so the wrapper is
   told ``grads_already_synced=True``; ``--muon-fsdp-mode`` etc. arrive as ``MuonFsdpConfig``).
   Stock megatron-core would build a ``TensorParallelMuon`` that trains nothing under no_shard and
   crashes under every sharded strategy (REFERENCE.md section 7). A custom loop calls
   ``build_muon_optimizer`` itself, saying whether it calls ``finish_grad_sync``.

Every other combination (adam or sgd with Megatron-FSDP, muon without Megatron-FSDP, ...) reaches
the original functions with the original arguments. Checked against megatron-core 0.19.0 and 0.19.2
(0.19.1 was never published): between them only the version strings, the inference text server,
``model_chunk_schedule_plan``, ``multi_token_prediction`` and ``transformer_layer`` changed; every
function patched here, and every module the factory, the step wrapper and the checkpointing import
(``megatron.training``, ``megatron.core.optimizer``, ``distributed``, the vendored
``megatron_fsdp``, ``fsdp_dtensor_checkpoint``) is byte-identical. ``install()`` accepts
``SUPPORTED_MEGATRON_CORE`` (pyproject.toml declares the same range) and raises on any other
version rather than patch code it has not read.
On a machine without a GPU, ``install()`` also applies ``megatron_muon.cpu_stand_ins.
install_for_training()`` (gloo/CPU runs); with a GPU nothing of that module is touched.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from megatron_muon.arguments import check_muon_args
from megatron_muon.megatron_fsdp_compat import uses_megatron_fsdp
from megatron_muon.step_wrapper import FsdpStepWrapper

__all__ = [
    "SUPPORTED_MEGATRON_CORE",
    "install",
    "installed",
    "extra_args_provider",
    "muon_meets_megatron_fsdp",
    "uses_megatron_fsdp",
    "MegatronCheckpointedOptimizer",
]

# The megatron-core versions whose patched functions were read (module docstring); pyproject.toml's
# dependency on megatron-core is the same range.
SUPPORTED_MEGATRON_CORE = ">=0.19.0,<0.20"

_INSTALLED = False


def installed() -> bool:
    """True once ``install()`` has run in this process."""
    return _INSTALLED


def install(*, cpu_stand_ins: bool | None = None) -> None:
    """Makes ``megatron.training`` accept and run ``--optimizer muon --use-megatron-fsdp``.

    Idempotent; call it before Megatron parses arguments (first line of the launcher script).

    Args:
        cpu_stand_ins: apply ``megatron_muon.cpu_stand_ins.install_for_training()``; default: when
            no GPU is present.

    Raises:
        RuntimeError: the installed megatron-core is not a version this patch was checked against.
    """
    global _INSTALLED
    _check_megatron_core_version()
    if cpu_stand_ins is None:
        cpu_stand_ins = not torch.cuda.is_available()
    if cpu_stand_ins:
        from megatron_muon import cpu_stand_ins as stand_ins

        stand_ins.install_for_training()
    if _INSTALLED:
        return
    arguments = importlib.import_module("megatron.training.arguments")
    training = importlib.import_module("megatron.training.training")

    arguments.parse_args = _with_muon_args(arguments.parse_args)
    arguments.validate_args = _accepting_muon_with_fsdp(arguments.validate_args, arguments)
    training.get_megatron_optimizer = _routing_muon_with_fsdp(training.get_megatron_optimizer)
    _INSTALLED = True


def _check_megatron_core_version() -> None:
    from packaging.specifiers import SpecifierSet

    package_info = importlib.import_module("megatron.core.package_info")
    version = package_info.__version__
    # prereleases=True: a 0.19.x release candidate is in range, a 0.19.0rc is not (< 0.19.0).
    if not SpecifierSet(SUPPORTED_MEGATRON_CORE).contains(version, prereleases=True):
        raise RuntimeError(
            f"megatron_muon.integrations.megatron_lm patches megatron.training functions as they "
            f"are in megatron-core {SUPPORTED_MEGATRON_CORE}; megatron-core {version} is "
            f"installed. Install a supported version (pip install 'megatron-core"
            f"{SUPPORTED_MEGATRON_CORE}'), or check the patched functions (see this module's "
            "docstring) against it and widen SUPPORTED_MEGATRON_CORE."
        )


# --------------------------------------------------------------------------------------------------
# 1. flags
# --------------------------------------------------------------------------------------------------


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider`` adding megatron-muon's flags (idempotent per parser)."""
    from megatron_muon.arguments import add_muon_args

    if "--muon-fsdp-mode" in parser._option_string_actions:
        return parser
    return add_muon_args(parser)


def _with_muon_args(parse_args: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(parse_args)
    def parse_args_with_muon(extra_args_provider_fn: Any = None, *args: Any, **kwargs: Any) -> Any:
        if "extra_args_provider" in kwargs:
            extra_args_provider_fn = kwargs.pop("extra_args_provider")

        def both(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
            if extra_args_provider_fn is not None:
                parser = extra_args_provider_fn(parser)
            return extra_args_provider(parser)

        return parse_args(both, *args, **kwargs)

    return parse_args_with_muon


# --------------------------------------------------------------------------------------------------
# 2. validate_args
# --------------------------------------------------------------------------------------------------


def muon_meets_megatron_fsdp(args: argparse.Namespace) -> bool:
    """True for the one combination this integration takes over: Muon with Megatron-FSDP."""
    return getattr(args, "optimizer", None) == "muon" and bool(
        getattr(args, "use_megatron_fsdp", False)
    )


def _accepting_muon_with_fsdp(validate_args: Callable[..., Any], arguments: Any) -> Callable:
    @functools.wraps(validate_args)
    def validate_args_accepting_muon(args: argparse.Namespace, *rest: Any, **kwargs: Any) -> Any:
        if not muon_meets_megatron_fsdp(args):
            return validate_args(args, *rest, **kwargs)
        if getattr(args, "fp16", False):
            # Refused here, before any process group exists, rather than at optimizer build.
            raise ValueError(
                "--optimizer muon with --use-megatron-fsdp does not support --fp16 (as in "
                "megatron-core): use --bf16 or fp32"
            )
        _take_over_qk_clip(args)
        _reduce_grads_across_hsdp_replicas(args)
        check_muon_args(args)  # a bad value stops here, naming its flag
        print_args = arguments._print_args

        def print_with_muon(title: str, printed: argparse.Namespace) -> None:
            printed.optimizer = "muon"
            print_args(title, printed)

        # The two refusals test args.optimizer; with "adam" in its place they pass, and Muon's
        # name is back before validate_args prints and returns the arguments.
        args.optimizer = "adam"
        arguments._print_args = print_with_muon
        try:
            result = validate_args(args, *rest, **kwargs)
        finally:
            arguments._print_args = print_args
            args.optimizer = "muon"
        if result is not None:
            result.optimizer = "muon"
        return result

    return validate_args_accepting_muon


def _take_over_qk_clip(args: argparse.Namespace) -> None:
    """``--qk-clip`` with muon + Megatron-FSDP: megatron-muon's ``QKClip`` clips, not Megatron's.

    Megatron's ``train_step`` calls ``megatron.core.optimizer.qk_clip.clip_qk(model)`` after the
    step when ``args.qk_clip``: it scales the module params, which under Megatron-FSDP are the
    compute weights that the next ``install_optimized_model_weights`` overwrites from the main
    weights (the clip would be lost), and it needs TE >= 2.9 for the max logits (``validate_args``
    asserts it). So ``args.qk_clip`` is turned off here (Megatron's ``clip_qk`` then never runs,
    nor its TE check) and ``args.muon_qk_clip`` on: ``megatron_muon.arguments.qk_clip_threshold``
    reads it and the factory builds a ``QKClip`` with ``--qk-clip-threshold``, run by the step
    wrapper on the main weights' row shards before they are installed. ``--qk-clip-alpha`` is
    not used (see ``megatron_muon.arguments``).
    """
    if getattr(args, "qk_clip", False):
        args.qk_clip = False
        args.muon_qk_clip = True


def _reduce_grads_across_hsdp_replicas(args: argparse.Namespace) -> None:
    """HSDP with Muon: ``--overlap-grad-reduce`` is turned on, with a warning.

    Under HSDP (``--num-distributed-optimizer-instances`` > 1) megatron-core 0.19.2's
    Megatron-FSDP reduces across the replicas (DP-outer group) only in its overlapped per-bucket
    reduction; with ``overlap_grad_reduce=False`` ``finish_grad_sync`` reduces over the inner
    group alone and each replica steps on its part of the batch, silently (tiny GPT, 4 ranks, 2
    replicas, ``optim``: iteration-1 grad norm 1.197, the 1-rank run's 2.002). Megatron-FSDP
    forces the flag itself for ``optim_grads``/``optim_grads_params``; the overlapped reduction
    computes the same sums. Announced as ``validate_args`` announces its own changes
    (``warn_rank_0``). Adam with HSDP is left as stock megatron-core has it.
    """
    if getattr(args, "num_distributed_optimizer_instances", 1) <= 1 or args.overlap_grad_reduce:
        return
    from megatron.training.utils import warn_rank_0

    args.overlap_grad_reduce = True
    warn_rank_0(
        "megatron-muon: HSDP (--num-distributed-optimizer-instances "
        f"{args.num_distributed_optimizer_instances}) with Megatron-FSDP reduces gradients across "
        "its replicas only with --overlap-grad-reduce: turning --overlap-grad-reduce on.",
        getattr(args, "rank", None),
    )


# --------------------------------------------------------------------------------------------------
# 3. get_megatron_optimizer
# --------------------------------------------------------------------------------------------------


def _routing_muon_with_fsdp(get_megatron_optimizer: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(get_megatron_optimizer)

    @functools.wraps(get_megatron_optimizer)
    def get_optimizer_routing_muon(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        config = bound.arguments["config"]
        model_chunks = bound.arguments["model_chunks"]
        if getattr(config, "optimizer", None) != "muon" or not uses_megatron_fsdp(model_chunks):
            return get_megatron_optimizer(*args, **kwargs)
        return _build_for_megatron_loop(
            config,
            model_chunks,
            config_overrides=bound.arguments.get("config_overrides"),
            pg_collection=bound.arguments.get("pg_collection"),
        )

    get_optimizer_routing_muon._megatron_muon_routed = True  # type: ignore[attr-defined]
    return get_optimizer_routing_muon


def _megatron_args() -> argparse.Namespace | None:
    """Megatron's parsed arguments when a Megatron-LM script set them, else None."""
    global_vars = importlib.import_module("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def _build_for_megatron_loop(
    config: Any, model_chunks: Any, *, config_overrides: Any, pg_collection: Any
) -> Any:
    """megatron-muon's optimizer for chunks that Megatron's ``train_step`` drives.

    Megatron's ``train_step`` runs ``finalize_model_grads`` (which calls ``finish_grad_sync`` on
    every chunk) before ``optimizer.step()``; a second call would reduce gradients twice and
    corrupt the ``optim`` strategy (REFERENCE.md section 9), hence ``grads_already_synced``.
    """
    from megatron_muon.config import MuonFsdpConfig
    from megatron_muon.factory import build_muon_optimizer

    args = _megatron_args()
    built = build_muon_optimizer(
        config,
        model_chunks,
        config_overrides=config_overrides,
        pg_collection=pg_collection,
        fsdp_config=MuonFsdpConfig.from_args(args) if args is not None else None,
        grads_already_synced=True,
    )
    # Megatron's default; off with --no-check-for-nan-in-loss-and-grad.
    stop = getattr(args, "check_for_nan_in_loss_and_grad", True) if args is not None else True
    return _with_fsdp_dtensor_checkpoints(built, model_chunks, stop_on_nonfinite_grad_norm=stop)


def _with_fsdp_dtensor_checkpoints(
    built: Any, model_chunks: Any, *, stop_on_nonfinite_grad_norm: bool = True
) -> Any:
    """The factory's step wrapper, as ``MegatronCheckpointedOptimizer`` (same parts)."""
    optimizer = MegatronCheckpointedOptimizer(
        built.inner,
        built.fsdp_modules,
        grads_already_synced=built.grads_already_synced,
        model_chunks=model_chunks,
        stop_on_nonfinite_grad_norm=stop_on_nonfinite_grad_norm,
    )
    for name in ("routing", "summary_lines", "qk_clip"):
        if hasattr(built, name):
            setattr(optimizer, name, getattr(built, name))
    return optimizer


class MegatronCheckpointedOptimizer(FsdpStepWrapper):
    """The FSDP step wrapper, with optimizer state in Megatron's ``fsdp_dtensor`` checkpoints.

    Megatron's ``save_checkpoint``/``load_checkpoint`` (``--ckpt-format fsdp_dtensor``) ask the
    optimizer for ``sharded_state_dict(..., metadata={"distrib_optim_sharding_type":
    "fsdp_dtensor"})`` and hand the loaded result to ``load_state_dict``. megatron-core's
    ``DistributedOptimizer`` answers with its state keyed by parameter name, every tensor a DTensor
    like its parameter, plus ``param_to_group_meta`` (its ``sharded_param_state_fsdp_dtensor``);
    the ``FP32Optimizer`` children of our chain only know the ``torch_dist`` ``ShardedTensor``
    format. This class gives the same layout, all leaf optimizers (Muon, AdamW) in one namespace,
    ``{"state": {name: {key: DTensor | step}}, "param_to_group_meta": {name: {...}}}``, so that
    Megatron's own fsdp_dtensor preprocessing (``--swiglu`` splits, expert renaming) applies.

    State exists for every param on every rank before the state dict is built
    (``megatron_muon.checkpointing.ensure_optimizer_state``, without a step): megatron_fsdp's
    uneven-DTensor preprocessing and DCP planning run collectives per DTensor, so a key missing on
    one rank (a rank holding 0 rows of a param) would hang the save (REFERENCE.md section 8).
    Names are ``DistributedOptimizer._param_name``'s: the model chunks' ``named_parameters()``
    (the Megatron-FSDP optimizer params, e.g. ``module.module.decoder.layers.0...``), with
    Megatron's expert renaming, which ``handle_swiglu_in_state_dict`` resolves on the model.

    A step whose global gradient norm is NaN or Inf is skipped on every rank (the chained
    optimizer's rule); with ``stop_on_nonfinite_grad_norm`` (Megatron's
    ``--check-for-nan-in-loss-and-grad``, on by default) ``step()`` then raises on every rank, so
    the run stops as Megatron stops on a NaN gradient, with the weights of the last good step.

    Args:
        model_chunks: the chunks as ``get_megatron_optimizer`` received them (Megatron's wrappers).
        stop_on_nonfinite_grad_norm: raise after skipping a step with a NaN or Inf grad norm.
        The rest: ``FsdpStepWrapper``'s.
    """

    def __init__(
        self,
        inner: Any,
        fsdp_modules: Any,
        *,
        grads_already_synced: bool,
        model_chunks: Any,
        stop_on_nonfinite_grad_norm: bool = True,
    ) -> None:
        super().__init__(inner, fsdp_modules, grads_already_synced=grads_already_synced)
        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        self.named_chunks = list(chunks)
        self.stop_on_nonfinite_grad_norm = stop_on_nonfinite_grad_norm

    def step(self) -> tuple[bool, float | None, float | None]:
        """``FsdpStepWrapper.step``; raises after a skipped step with a NaN or Inf grad norm.

        Raises:
            RuntimeError: the grad norm is not finite and ``stop_on_nonfinite_grad_norm`` (on every
                rank alike: the norm is global).
        """
        result = super().step()
        update_successful, grad_norm, _ = result
        if (
            self.stop_on_nonfinite_grad_norm
            and not update_successful
            and grad_norm is not None
            and not math.isfinite(grad_norm)
        ):
            args = _megatron_args()
            iteration = getattr(args, "curr_iteration", None)
            where = f"iteration {iteration + 1}: " if iteration is not None else ""
            raise RuntimeError(
                f"{where}found {grad_norm} in the global gradient norm (a NaN or Inf gradient on "
                "some rank): the optimizer step was skipped on every rank, the weights are the "
                "last good step's. Stopping, as Megatron-LM does with "
                "--check-for-nan-in-loss-and-grad (pass --no-check-for-nan-in-loss-and-grad to "
                "skip such steps and train on)"
            )
        return result

    def _names(self) -> dict[int, str]:
        from megatron.core.transformer.fsdp_dtensor_checkpoint import (
            handle_experts_in_state_dict,
        )

        name_to_param: dict[str, torch.Tensor] = {}
        for chunk in self.named_chunks:
            name_to_param.update(dict(chunk.named_parameters()))
        config = getattr(self.named_chunks[0], "config", None)
        num_experts = getattr(config, "num_moe_experts", None)
        name_to_param = handle_experts_in_state_dict(name_to_param, num_experts)
        names = {id(param): name for name, param in name_to_param.items()}
        unnamed = [p for p in self.get_parameters() if id(p) not in names]
        if unnamed:
            raise RuntimeError(
                f"{len(unnamed)} optimizer params are not parameters of the model chunks: the "
                "optimizer must be built from Megatron-FSDP's optimizer params"
            )
        return names

    def _leaves(self) -> list[torch.optim.Optimizer]:
        from megatron_muon.checkpointing import leaf_optimizers

        return leaf_optimizers(self.inner)

    def sharded_state_dict(
        self,
        model_sharded_state_dict: Any,
        is_loading: bool = False,
        metadata: dict | None = None,
        **kwargs: Any,
    ) -> dict[str, dict[str, Any]]:
        """Optimizer state by param name, DTensors like the params (save and load template)."""
        from megatron_muon.checkpointing import ensure_optimizer_state

        sharding = (metadata or {}).get("distrib_optim_sharding_type")
        if sharding != "fsdp_dtensor":
            raise NotImplementedError(
                f"Muon with Megatron-FSDP checkpoints in --ckpt-format fsdp_dtensor only, got "
                f"distrib_optim_sharding_type={sharding!r}"
            )
        ensure_optimizer_state(self.inner)
        names = self._names()
        state: dict[str, Any] = {}
        group_meta: dict[str, Any] = {}
        for leaf in self._leaves():
            for group in leaf.param_groups:
                meta = {key: value for key, value in group.items() if key != "params"}
                for param in group["params"]:
                    state[names[id(param)]] = leaf.state[param]
                    group_meta[names[id(param)]] = meta
        return {"state": state, "param_to_group_meta": group_meta}

    def load_state_dict(self, state_dict: Any) -> None:
        """Loads what ``sharded_state_dict`` described (after DCP filled it), by param name."""
        if not (isinstance(state_dict, dict) and "param_to_group_meta" in state_dict):
            super().load_state_dict(state_dict)
            return
        names = self._names()
        saved_state, saved_meta = state_dict["state"], state_dict["param_to_group_meta"]
        for leaf in self._leaves():
            groups = []
            for group in leaf.param_groups:
                params = [names[id(p)] for p in group["params"]]
                missing = [name for name in params if name not in saved_state]
                if missing:
                    raise KeyError(f"the checkpoint holds no optimizer state for {missing}")
                meta = saved_meta.get(params[0], {}) if params else {}
                groups.append({**meta, "params": params})
            state = {name: saved_state[name] for group in groups for name in group["params"]}
            # torch maps saved params to current ones by position in param_groups; both are
            # the current groups' param names, so the name-keyed state lands on the right param.
            leaf.load_state_dict({"state": state, "param_groups": groups})

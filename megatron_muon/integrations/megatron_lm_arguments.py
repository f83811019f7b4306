"""Megatron-LM's arguments for ``--optimizer <FsdpOptimizerT> --use-megatron-fsdp``:
two patched functions.

``megatron_muon.integrations.megatron_lm.install()`` applies both, under its megatron-core version
check (``SUPPORTED_MEGATRON_CORE``); what each does and why is in that module's docstring (items 1
and 2) and in each function's below.

- ``with_muon_args(parse_args)``: megatron-muon's flags after the caller's ``extra_args_provider``;
  every bare ``%`` in the parser's help escaped (``escape_bare_percent_in_help``), so ``--help``
  works; Megatron's ``--muon-tp-mode`` also takes ``layer_sharded`` (``TpModeT``).
- ``accepting_muon_with_fsdp(validate_args, arguments)``: an optimizer megatron-muon builds
  (``FsdpOptimizerT``: Muon, adaptive Muon, Lion, SOAP, ...) with Megatron-FSDP gets past the
  two refusals of megatron-core 0.19.2's ``validate_args``; ``--fp16`` is refused,
  ``--qk-clip`` is taken over, HSDP turns ``--overlap-grad-reduce`` on and (Muon, adaptive Muon)
  the Muon flags' values are checked (and each optimizer's own settings flags); ``--async-save``
  is refused; Muon or adaptive Muon without Megatron-FSDP (stock ``TensorParallelMuon`` and its
  subclass) is refused ``layer_sharded``.
"""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Callable
from typing import Any, get_args

from megatron_muon.common.options import FsdpOptimizerT, TpModeT
from megatron_muon.fsdp.arguments import SETTINGS_BEYOND_OPTIMIZER_CONFIG, check_muon_args
from megatron_muon.fsdp.optimizer_registry import megatron_lm_optimizer_names
from megatron_muon.optimizers.adaptive_muon_config import AdaptiveMuonConfig
from megatron_muon.optimizers.settings import read_settings
from megatron_muon.optimizers.soap_matrix import SoapConfig

__all__ = [
    "escape_bare_percent_in_help",
    "extra_args_provider",
    "with_muon_args",
    "muon_meets_megatron_fsdp",
    "accepting_muon_with_fsdp",
]


# megatron-core 0.19.2's --muon-tp-mode choices (what its TensorParallelMuon knows); ours beyond.
_STOCK_TP_MODES = ("blockwise", "duplicated", "distributed")
_OUR_TP_MODES = tuple(mode for mode in get_args(TpModeT) if mode not in _STOCK_TP_MODES)

# --------------------------------------------------------------------------------------------------
# 1. flags
# --------------------------------------------------------------------------------------------------


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider`` adding megatron-muon's flags (idempotent per parser), and
    widening Megatron's own ``--muon-tp-mode`` choices to ours (``TpModeT``: megatron-core
    0.19.2 lists blockwise, duplicated, distributed; ``layer_sharded`` runs in ``ShardedMuon``
    only, which ``accepting_muon_with_fsdp`` makes sure of), and its ``--optimizer`` choices to
    the registry's (``fsdp.optimizer_registry.megatron_lm_optimizer_names``; megatron-core 0.19.2
    lacks psgd_pro, rekls and the row-wise ones)."""
    from megatron_muon.fsdp.arguments import add_muon_args

    _widen_choices(parser, "--muon-tp-mode", _OUR_TP_MODES)
    _widen_choices(parser, "--optimizer", megatron_lm_optimizer_names())
    if "--muon-fsdp-mode" in parser._option_string_actions:
        return parser
    return add_muon_args(parser)


def _widen_choices(parser: argparse.ArgumentParser, option: str, ours: tuple[str, ...]) -> None:
    """Megatron's ``option`` also takes ``ours`` (where it exists and has choices):
    ``--muon-tp-mode`` ``layer_sharded``; ``--optimizer`` every ``FsdpOptimizerT`` name
    (megatron-core 0.19.2 lists adam, sgd, muon, dist_muon, lion, soap, adaptive_muon), which
    runs with ``--use-megatron-fsdp`` (``accepting_muon_with_fsdp``)."""
    action = parser._option_string_actions.get(option)
    if action is not None and action.choices is not None:
        action.choices = [*action.choices, *(c for c in ours if c not in action.choices)]


def with_muon_args(parse_args: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(parse_args)
    def parse_args_with_muon(extra_args_provider_fn: Any = None, *args: Any, **kwargs: Any) -> Any:
        if "extra_args_provider" in kwargs:
            extra_args_provider_fn = kwargs.pop("extra_args_provider")

        def both(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
            if extra_args_provider_fn is not None:
                parser = extra_args_provider_fn(parser)
            return escape_bare_percent_in_help(extra_args_provider(parser))

        return parse_args(both, *args, **kwargs)

    return parse_args_with_muon


# What argparse's help formatting (``help % params``) reads as its own: ``%%`` or
# ``%(name)<conversion>``; any other ``%`` is bare.
_HELP_FORMAT = re.compile(r"%%|%\([^)]*\)[-#0 +]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa]|%")


def escape_bare_percent_in_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` with every bare ``%`` in its actions' help doubled, so that ``--help`` formats.

    argparse formats each help string with ``%`` (for ``%(default)s``), so one bare ``%`` stops
    ``--help`` with "unsupported format character": megatron-core 0.19.2's help of
    ``--moe-paged-stash-buffer-size-factor-cuda`` ends "e.g. 1.10 = 10%)." (Megatron-LM's own
    ``pretrain_gpt.py --help`` fails the same way). ``%%`` and ``%(name)s`` are kept; idempotent.
    """
    for action in parser._actions:
        if action.help and "%" in action.help:
            action.help = _HELP_FORMAT.sub(
                lambda match: "%%" if match.group() == "%" else match.group(), action.help
            )
    return parser


# --------------------------------------------------------------------------------------------------
# 2. validate_args
# --------------------------------------------------------------------------------------------------


def muon_meets_megatron_fsdp(args: argparse.Namespace) -> bool:
    """True for the combinations this integration takes over: an optimizer megatron-muon builds
    for Megatron-FSDP (``FsdpOptimizerT``: muon, adaptive_muon, lion, soap, ...) with
    ``--use-megatron-fsdp``."""
    return getattr(args, "optimizer", None) in get_args(FsdpOptimizerT) and bool(
        getattr(args, "use_megatron_fsdp", False)
    )


def accepting_muon_with_fsdp(validate_args: Callable[..., Any], arguments: Any) -> Callable:
    @functools.wraps(validate_args)
    def validate_args_accepting_muon(args: argparse.Namespace, *rest: Any, **kwargs: Any) -> Any:
        if not muon_meets_megatron_fsdp(args):
            _refuse_our_tp_modes_for_stock_muon(args)
            return validate_args(args, *rest, **kwargs)
        name = args.optimizer
        if getattr(args, "fp16", False):
            # Refused here, before any process group exists, rather than at optimizer build.
            raise ValueError(
                f"--optimizer {name} with --use-megatron-fsdp does not support --fp16 (as in "
                "megatron-core): use --bf16 or fp32"
            )
        _take_over_qk_clip(args)
        _reduce_grads_across_hsdp_replicas(args)
        if name in ("muon", "adaptive_muon"):
            check_muon_args(args)  # a bad value stops here, naming its flag
        if name == "adaptive_muon":
            AdaptiveMuonConfig.from_optimizer_config(args)  # names the adaptive_muon_ field
        if name == "soap":
            SoapConfig.from_optimizer_config(args)  # names the soap_ field
        if name in SETTINGS_BEYOND_OPTIMIZER_CONFIG:
            read_settings(SETTINGS_BEYOND_OPTIMIZER_CONFIG[name], args)  # names the <name>_ field
        print_args = arguments._print_args

        def print_with_name(title: str, printed: argparse.Namespace) -> None:
            printed.optimizer = name
            print_args(title, printed)

        # The two refusals test args.optimizer; with "adam" in its place they pass, and the
        # optimizer's name is back before validate_args prints and returns the arguments.
        args.optimizer = "adam"
        arguments._print_args = print_with_name
        try:
            result = validate_args(args, *rest, **kwargs)
        finally:
            arguments._print_args = print_args
            args.optimizer = name
        if result is not None:
            result.optimizer = name
        _refuse_async_save(args)
        return result

    return validate_args_accepting_muon


def _refuse_async_save(args: argparse.Namespace) -> None:
    """``--async-save`` with muon + Megatron-FSDP stops here, naming the flag.

    Checked after Megatron's ``validate_args``, which turns ``--async-save`` off (with a warning)
    unless ``--use-persistent-ckpt-worker`` is given. What is left would fail at the first save in
    megatron-core 0.19.2 (measured, 2 CPU ranks, ``--async-strategy mcore``: "TypeError:
    save_state_dict_async_plan() got an unexpected keyword argument 'enable_cache'", after the
    checkpoint directory was created; the default ``nvrx`` strategy needs nvidia-resiliency-ext),
    and ``checkpoint_guards.integrity`` records and checks files that must be whole when
    ``save_checkpoint`` returns.
    """
    if getattr(args, "async_save", False):
        raise ValueError(
            f"--async-save with --optimizer {args.optimizer} --use-megatron-fsdp is not supported: "
            "megatron-core 0.19.2's asynchronous fsdp_dtensor save fails at the first save "
            "(--async-strategy mcore: save_state_dict_async_plan() gets an unexpected keyword "
            "'enable_cache'; nvrx needs nvidia-resiliency-ext), and megatron-muon hashes each "
            "checkpoint's files once they are written. Drop --async-save: saves are then "
            "synchronous"
        )


def _refuse_our_tp_modes_for_stock_muon(args: argparse.Namespace) -> None:
    """A ``--muon-tp-mode`` megatron-core's ``TensorParallelMuon`` does not know (widened into
    the choices by ``extra_args_provider``) is refused where stock Muon would get it: Muon
    without ``--use-megatron-fsdp`` (adaptive Muon's stock class is a ``TensorParallelMuon``)."""
    mode = getattr(args, "muon_tp_mode", None)
    if getattr(args, "optimizer", None) in ("muon", "adaptive_muon") and mode in _OUR_TP_MODES:
        raise ValueError(
            f"--muon-tp-mode {mode} runs in megatron-muon's ShardedMuon, with "
            "--use-megatron-fsdp; megatron-core's TensorParallelMuon (Muon without it) knows "
            f"{', '.join(_STOCK_TP_MODES)}"
        )


def _take_over_qk_clip(args: argparse.Namespace) -> None:
    """``--qk-clip`` with muon + Megatron-FSDP: megatron-muon's ``QKClip`` clips, not Megatron's.

    Megatron's ``train_step`` calls ``megatron.core.optimizer.qk_clip.clip_qk(model)`` after the
    step when ``args.qk_clip``: it scales the module params, which under Megatron-FSDP are the
    compute weights that the next ``install_optimized_model_weights`` overwrites from the main
    weights (the clip would be lost), and it needs TE >= 2.9 for the max logits (``validate_args``
    asserts it). So ``args.qk_clip`` is turned off here (Megatron's ``clip_qk`` then never runs,
    nor its TE check) and ``args.muon_qk_clip`` on: ``fsdp.arguments.qk_clip_config_from_args``
    reads it and the factory builds a ``QKClip`` with ``--qk-clip-threshold`` and
    ``--qk-clip-alpha``, run by the step wrapper on the main weights' row shards before they are
    installed.
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
    replicas, ``optim``; measured: docs/megatron-fsdp-measurements.md). Megatron-FSDP
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

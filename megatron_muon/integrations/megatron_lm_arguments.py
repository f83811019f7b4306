"""Megatron-LM's arguments for ``--optimizer muon --use-megatron-fsdp``: two patched functions.

``megatron_muon.integrations.megatron_lm.install()`` applies both, under its megatron-core version
check (``SUPPORTED_MEGATRON_CORE``); what each does and why is in that module's docstring (items 1
and 2) and in each function's below.

- ``with_muon_args(parse_args)``: megatron-muon's flags after the caller's ``extra_args_provider``;
  every bare ``%`` in the parser's help escaped (``escape_bare_percent_in_help``), so ``--help``
  works.
- ``accepting_muon_with_fsdp(validate_args, arguments)``: Muon with Megatron-FSDP gets past the two
  refusals of megatron-core 0.19.2's ``validate_args``; ``--fp16`` is refused, ``--qk-clip`` is
  taken over, HSDP turns ``--overlap-grad-reduce`` on and the Muon flags' values are checked.
"""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Callable
from typing import Any

from megatron_muon.fsdp.arguments import check_muon_args
from megatron_muon.sharded.adaptive_muon import AdaptiveMuonConfig

__all__ = [
    "escape_bare_percent_in_help",
    "extra_args_provider",
    "with_muon_args",
    "muon_meets_megatron_fsdp",
    "accepting_muon_with_fsdp",
]


# --------------------------------------------------------------------------------------------------
# 1. flags
# --------------------------------------------------------------------------------------------------


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider`` adding megatron-muon's flags (idempotent per parser)."""
    from megatron_muon.fsdp.adaptive_muon_arguments import add_adaptive_muon_args
    from megatron_muon.fsdp.arguments import add_muon_args

    if "--muon-fsdp-mode" in parser._option_string_actions:
        return parser
    return add_adaptive_muon_args(add_muon_args(parser))


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


# The --optimizer values whose Megatron-FSDP runs this integration takes over (the factory's).
FSDP_OPTIMIZERS = ("muon", "adaptive_muon")


def muon_meets_megatron_fsdp(args: argparse.Namespace) -> bool:
    """True for the combination this integration takes over: Muon (or adaptive Muon) with
    Megatron-FSDP."""
    return getattr(args, "optimizer", None) in FSDP_OPTIMIZERS and bool(
        getattr(args, "use_megatron_fsdp", False)
    )


def accepting_muon_with_fsdp(validate_args: Callable[..., Any], arguments: Any) -> Callable:
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
        name = args.optimizer
        if name == "adaptive_muon":
            AdaptiveMuonConfig.from_optimizer_config(args)  # names the adaptive_muon_ field
        print_args = arguments._print_args

        def print_with_muon(title: str, printed: argparse.Namespace) -> None:
            printed.optimizer = name
            print_args(title, printed)

        # The two refusals test args.optimizer; with "adam" in its place they pass, and Muon's
        # name is back before validate_args prints and returns the arguments.
        args.optimizer = "adam"
        arguments._print_args = print_with_muon
        try:
            result = validate_args(args, *rest, **kwargs)
        finally:
            arguments._print_args = print_args
            args.optimizer = name
        if result is not None:
            result.optimizer = name
        return result

    return validate_args_accepting_muon


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

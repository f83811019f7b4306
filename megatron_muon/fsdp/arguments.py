"""Command-line flags for Muon on Megatron-FSDP, in Megatron-LM's style.

``add_muon_args(parser)`` has the shape of Megatron's ``extra_args_provider`` (takes a parser,
returns it). It adds

- megatron-muon's own flags (below), and
- Megatron-LM's Muon flags (``--optimizer``, ``--muon-momentum``, ``--muon-nesterov``, ...) with
  Megatron-LM's names, choices and defaults, **only where the parser lacks them**: on Megatron's
  own parser (``megatron.training.arguments``) they already exist and are left alone, so the same
  function serves Megatron-LM's loop and a parser of our own.

megatron-muon's flags (each maps to one keyword of ``megatron_muon.ShardedMuon``):

- ``--muon-fsdp-mode {owner,gather}`` (owner): where Newton-Schulz runs on Megatron-FSDP shards;
  ``owner`` orthogonalizes each full matrix once on one owner rank, ``gather`` on every rank.
- ``--muon-fsdp-bucket-size-mb`` (16): bound on the fp32 full matrices one rank holds at once,
  i.e. the owner step's peak extra memory; a bound above the model's matrices gives one bucket.
- ``--muon-ns-method {standard,gram}`` (standard): Newton-Schulz or Gram Newton-Schulz.
- ``--muon-gram-half-dtype {float16,bfloat16}`` (float16): Gram NS matmul dtype under
  ``--muon-fp32-matmul-prec medium``.
- ``--muon-gram-restarts N [N ...]`` (default restarts): Gram NS restart iterations.
- ``--muon-offload-momentum``: keep Muon momentum in CPU memory between steps.
- ``--[no-]muon-fsdp-overlap-buckets`` (off): owner mode: exchange the next bucket while this one
  runs NS (two buckets' full matrices held at once).

Choices and defaults come from the options' ``Literal`` aliases and ``MuonFsdpConfig``'s defaults;
``MuonFsdpConfig.from_args(args)`` turns parsed args into those keywords, and
``check_muon_args(args)`` checks the values of these flags and of Megatron's ``--muon-*`` flags
where a Muon run reads them (``megatron_muon.integrations.megatron_lm`` calls it from
``validate_args``) with the configs' own rules, with errors that name the flag.

QK-clip (MuonClip, ``megatron_muon.fsdp.qk_clip``) is switched on by a threshold, read with
``megatron_muon.sharded.config.qk_clip_threshold(args)``:

- on a parser of our own, ``--qk-clip-threshold TAU`` (default None = off) is added here;
- on Megatron-LM's parser, which already has ``--qk-clip`` (switch), ``--qk-clip-threshold``
  (default 100) and ``--qk-clip-alpha``, nothing is added: QK-clip is on exactly when ``--qk-clip``
  is given, with Megatron's ``--qk-clip-threshold`` (with muon + Megatron-FSDP,
  ``megatron_muon.integrations.megatron_lm`` moves ``--qk-clip`` to ``args.muon_qk_clip`` so that
  Megatron's own ``clip_qk`` does not run on the compute weights). ``--qk-clip-alpha`` (Megatron's
  split of the factor between q and k, default 0.5) is Megatron's flag there and added here
  otherwise; ``QKClip`` scales queries by ``eta^alpha`` and keys by ``eta^(1 - alpha)`` and gives
  every GQA head exactly its own factor (``qk_clip_rows``).
"""

from __future__ import annotations

import argparse
from typing import Any, get_args

from megatron_muon.common.options import (
    FsdpModeT,
    GramHalfDtypeT,
    MuonScaleT,
    ScalarOptimizerT,
    TpModeT,
)
from megatron_muon.newton_schulz.methods import NSConfig, NSMethodT
from megatron_muon.sharded.config import (
    DEFAULT_BUCKET_SIZE_BYTES,
    DEFAULT_QK_CLIP_ALPHA,
    MuonConfig,
    MuonFsdpConfig,
    qk_clip_threshold,
)

__all__ = ["add_muon_args", "check_muon_args"]

_GROUP_TITLE = "megatron-muon"
_DEFAULTS = MuonFsdpConfig()


def _has_option(parser: argparse.ArgumentParser, option: str) -> bool:
    return option in parser._option_string_actions


def add_muon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds megatron-muon's flags (and Megatron-LM's Muon flags where missing) to ``parser``."""
    group = parser.add_argument_group(title=_GROUP_TITLE)
    _add_megatron_muon_flags(parser, group)
    group.add_argument(
        "--muon-fsdp-mode",
        choices=get_args(FsdpModeT),
        default=_DEFAULTS.mode,
        help="Where Newton-Schulz runs on Megatron-FSDP shards: 'owner' orthogonalizes each full "
        "matrix once, on one owner rank (NS work ~ 1/DP per rank); 'gather' on every rank.",
    )
    group.add_argument(
        "--muon-fsdp-bucket-size-mb",
        type=float,
        default=DEFAULT_BUCKET_SIZE_BYTES / 2**20,
        help="Bound (MiB of fp32) on the full matrices one rank holds at once for Newton-Schulz "
        "(matrices are exchanged and orthogonalized bucket by bucket); a bound above the model's "
        "matrices gives one bucket.",
    )
    group.add_argument(
        "--muon-ns-method",
        choices=get_args(NSMethodT),
        default=_DEFAULTS.ns_method,
        help="Newton-Schulz iteration: 'standard' (megatron-core's), 'gram' (Gram "
        "Newton-Schulz) or 'symmetric' (the standard iteration, its symmetric products by halves: "
        "12-17%% fewer FLOPs; never split over ranks).",
    )
    group.add_argument(
        "--muon-gram-half-dtype",
        choices=get_args(GramHalfDtypeT),
        default=_DEFAULTS.gram_half_dtype,
        help="Gram Newton-Schulz matmul dtype under --muon-fp32-matmul-prec medium (fp32 under "
        "high/highest). bfloat16 where fp16 matmuls are slow (CPUs).",
    )
    group.add_argument(
        "--muon-gram-restarts",
        type=int,
        nargs="+",
        default=_DEFAULTS.gram_restarts,
        help="Gram Newton-Schulz: iterations after which X and X X^T are rebuilt (each in "
        "[1, --muon-num-ns-steps), increasing); default: the method's own for the dtype.",
    )
    group.add_argument(
        "--muon-offload-momentum",
        action="store_true",
        help="Keep Muon momentum in CPU memory between optimizer steps.",
    )
    group.add_argument(
        "--muon-fsdp-overlap-buckets",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.overlap_buckets,
        help="Owner mode: exchange the next bucket while this one runs Newton-Schulz "
        "(two buckets' full matrices held at once; the same updates).",
    )
    if not _has_option(parser, "--qk-clip-threshold"):
        # Megatron-LM's parser has --qk-clip / --qk-clip-threshold already (module docstring).
        group.add_argument(
            "--qk-clip-threshold",
            type=float,
            default=None,
            help="QK-clip (MuonClip): after each step, scale the q/k weight rows of every "
            "attention head whose max pre-softmax logit exceeded this threshold. Default: off.",
        )
    if not _has_option(parser, "--qk-clip-alpha"):
        group.add_argument(
            "--qk-clip-alpha",
            type=float,
            default=DEFAULT_QK_CLIP_ALPHA,
            help="QK-clip: the query side's share of a head's logit factor eta (queries scaled by "
            "eta^alpha, keys by eta^(1-alpha)), in (0, 1). Megatron-LM's flag and default.",
        )
    return parser


def _add_megatron_muon_flags(
    parser: argparse.ArgumentParser, group: argparse._ArgumentGroup
) -> None:
    """Megatron-LM's Muon flags (megatron/training/arguments.py, core_r0.19.0), where missing."""
    flags: list[tuple[str, dict[str, Any]]] = [
        ("--optimizer", dict(type=str, default="adam", choices=["adam", "sgd", "muon"])),
        ("--muon-momentum", dict(type=float, default=0.9)),
        ("--muon-no-split-qkv", dict(action="store_false", dest="muon_split_qkv", default=True)),
        ("--muon-nesterov", dict(action="store_true", default=False)),
        (
            "--muon-scale-mode",
            dict(type=str, default="spectral", choices=get_args(MuonScaleT)),
        ),
        (
            "--muon-fp32-matmul-prec",
            dict(type=str, default="medium", choices=["low", "medium", "high"]),
        ),
        ("--muon-coefficient-type", dict(type=str, default="quintic")),
        ("--muon-num-ns-steps", dict(type=int, default=5)),
        (
            "--muon-tp-mode",
            dict(type=str, default="blockwise", choices=get_args(TpModeT)),
        ),
        ("--muon-extra-scale-factor", dict(type=float, default=1.0)),
        (
            "--muon-scalar-optimizer",
            dict(type=str, default="adam", choices=get_args(ScalarOptimizerT)),
        ),
    ]
    for option, kwargs in flags:
        if not _has_option(parser, option):
            group.add_argument(option, **kwargs)


def check_muon_args(args: argparse.Namespace) -> None:
    """Checks the Muon flags' values as the configs built from them will, naming the flag.

    The rules are the configs' own (``MuonConfig``, ``NSConfig``, ``MuonFsdpConfig``); run at
    argument validation, a bad value stops the run there with ``--flag VALUE: reason`` instead of
    failing at optimizer build with the config's field name.

    Raises:
        ValueError: the first flag whose value is refused.
    """
    # Unchecked flag values (Any): the configs below check them.
    steps: Any = getattr(args, "muon_num_ns_steps", 5)
    method: Any = getattr(args, "muon_ns_method", "standard")
    half: Any = getattr(args, "muon_gram_half_dtype", "float16")
    # The NS flags first: MuonConfig checks its NS fields too, and would name --muon-momentum.
    checks = [
        ("--muon-num-ns-steps", "muon_num_ns_steps", lambda v: NSConfig(num_ns_steps=v)),
        (
            "--muon-coefficient-type",
            "muon_coefficient_type",
            lambda v: NSConfig(num_ns_steps=steps, coefficient_type=v),
        ),
        (
            "--muon-gram-restarts",
            "muon_gram_restarts",
            lambda v: NSConfig(
                num_ns_steps=steps, ns_method=method, gram_restarts=v, gram_half_dtype=half
            ),
        ),
        ("--muon-momentum", "muon_momentum", lambda v: MuonConfig.from_optimizer_config(args)),
        (
            "--qk-clip-threshold",
            "qk_clip_threshold",
            lambda v: MuonFsdpConfig(qk_clip_threshold=qk_clip_threshold(args)),
        ),
        (
            "--qk-clip-alpha",
            "qk_clip_alpha",
            lambda v: MuonFsdpConfig(qk_clip_threshold=qk_clip_threshold(args), qk_clip_alpha=v),
        ),
    ]
    for flag, name, build in checks:
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        try:
            build(value)
        except ValueError as error:
            raise ValueError(f"{flag} {value}: {error}") from None
    MuonFsdpConfig.from_args(args)  # the megatron-muon flags, together; names the bucket flag

"""Command-line flags for Muon on Megatron-FSDP, in Megatron-LM's style, and the configs they give.

``add_muon_args(parser)`` has the shape of Megatron's ``extra_args_provider`` (takes a parser,
returns it). It adds

- megatron-muon's own flags, one per ``MuonFsdpConfig`` field (``--muon-<field>``, or
  ``--muon-fsdp-<field>`` for ``mode`` and ``overlap_buckets``; ``bucket_size_bytes`` is
  ``--muon-fsdp-bucket-size-mb``): each flag's default is the field's, its choices the field's
  ``Literal`` values (``megatron_muon.common.options``); and
- Megatron-LM's Muon flags (``--optimizer`` and ``--muon-<field>`` for each ``MuonConfig`` field)
  with Megatron-LM's names, choices and defaults, **only where the parser lacks them**: on
  Megatron's own parser (``megatron.training.arguments``) they already exist and are left alone, so
  the same function serves Megatron-LM's loop and a parser of our own.

Parsed flags become configs here: ``fsdp_config_from_args(args)`` (a ``MuonFsdpConfig``, what
``ShardedMuon`` takes) and ``qk_clip_config_from_args(args)`` (a ``QKClipConfig`` or None, what
the factory builds QK-clip from). ``check_muon_args(args)`` checks the values of these flags and of
Megatron's ``--muon-*`` flags where a Muon run reads them (``megatron_muon.integrations`` calls it
from ``validate_args``) with the configs' own rules, with errors that name the flag.

QK-clip (MuonClip, ``megatron_muon.fsdp.qk_clip``) is switched on by a threshold:

- on a parser of our own, ``--qk-clip-threshold TAU`` (default None = off) is added here;
- on Megatron-LM's parser, which already has ``--qk-clip`` (switch), ``--qk-clip-threshold``
  (default 100) and ``--qk-clip-alpha``, nothing is added: QK-clip is on exactly when ``--qk-clip``
  is given, with Megatron's ``--qk-clip-threshold`` (with muon + Megatron-FSDP,
  ``megatron_muon.integrations.megatron_lm_arguments`` moves ``--qk-clip`` to
  ``args.muon_qk_clip`` so that Megatron's own ``clip_qk`` does not run on the compute weights).
  ``--qk-clip-alpha`` (Megatron's split of the factor between q and k, default 0.5) is Megatron's
  flag there and added here otherwise; ``QKClip`` scales queries by ``eta^alpha`` and keys by
  ``eta^(1 - alpha)`` and gives every GQA head exactly its own factor (``qk_clip_rows``).
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from megatron_muon.common.options import MegatronMatmulPrecT, MegatronOptimizerT
from megatron_muon.fsdp.qk_clip import QKClipConfig
from megatron_muon.fsdp.qk_clip_rows import DEFAULT_ALPHA
from megatron_muon.newton_schulz.methods import NSConfig
from megatron_muon.sharded.config import MuonConfig, MuonFsdpConfig

__all__ = ["add_muon_args", "check_muon_args", "fsdp_config_from_args", "qk_clip_config_from_args"]

_GROUP_TITLE = "megatron-muon"
_MIB = 2**20
_FSDP_DEFAULTS = MuonFsdpConfig()
_MUON_DEFAULTS = MuonConfig()

# Our flags, by the ``MuonFsdpConfig`` field each sets: argparse's keywords but default and choices
# (the field's). The flag is ``--muon-<field>`` unless ``_FSDP_FLAG_NAMES`` names it.
_FSDP_FLAGS: dict[str, dict[str, Any]] = {
    "mode": dict(
        help="Where Newton-Schulz runs on Megatron-FSDP shards: 'owner' orthogonalizes each full "
        "matrix once, on one owner rank (NS work ~ 1/DP per rank); 'gather' on every rank."
    ),
    "bucket_size_bytes": dict(
        type=float,
        help="Bound (MiB of fp32) on the full matrices one rank holds at once for Newton-Schulz "
        "(matrices are exchanged and orthogonalized bucket by bucket); a bound above the model's "
        "matrices gives one bucket.",
    ),
    "ns_method": dict(
        help="Newton-Schulz iteration: 'standard' (megatron-core's), 'gram' (Gram "
        "Newton-Schulz) or 'symmetric' (the standard iteration, its symmetric products by halves: "
        "12-17%% fewer FLOPs; never split over ranks)."
    ),
    "gram_half_dtype": dict(
        help="Gram Newton-Schulz matmul dtype under --muon-fp32-matmul-prec medium (fp32 under "
        "high/highest). bfloat16 where fp16 matmuls are slow (CPUs)."
    ),
    "gram_restarts": dict(
        type=int,
        nargs="+",
        help="Gram Newton-Schulz: iterations after which X and X X^T are rebuilt (each in "
        "[1, --muon-num-ns-steps), increasing); default: the method's own for the dtype.",
    ),
    "offload_momentum": dict(
        action="store_true", help="Keep Muon momentum in CPU memory between optimizer steps."
    ),
    "overlap_buckets": dict(
        action=argparse.BooleanOptionalAction,
        help="Owner mode: exchange the next bucket while this one runs Newton-Schulz "
        "(two buckets' full matrices held at once; the same updates).",
    ),
    "use_syrk": dict(
        action="store_true",
        help="Run the standard Newton-Schulz iteration through emerging-optimizers' Triton syrk "
        "kernels (Megatron-LM main's flag): CUDA GPUs of SM 8.0/9.0/10.x with Triton >= 3.4, "
        "bf16 iteration (--muon-fp32-matmul-prec medium); refused elsewhere.",
    ),
}
_FSDP_FLAG_NAMES = {
    "mode": "--muon-fsdp-mode",
    "bucket_size_bytes": "--muon-fsdp-bucket-size-mb",  # in MiB, the field in bytes
    "overlap_buckets": "--muon-fsdp-overlap-buckets",
}
assert set(_FSDP_FLAGS) == {f.name for f in fields(MuonFsdpConfig)}, "a flag per field"

# Where Megatron-LM's parser (core_r0.19.0 megatron/training/arguments.py) differs from the rule
# ``--muon-<field>``, ``MuonConfig``'s default and the field's Literal choices.
_MEGATRON_DEFAULTS = {"momentum": 0.9}  # OptimizerConfig's is 0.95, the parser's 0.9
_MEGATRON_CHOICES = {"fp32_matmul_prec": get_args(MegatronMatmulPrecT)}


def _option(field: str) -> str:
    return _FSDP_FLAG_NAMES.get(field, "--muon-" + field.replace("_", "-"))


def _dest(option: str) -> str:
    """The flag's attribute on parsed args, as argparse names it (``--muon-ns-method``:
    ``muon_ns_method``)."""
    return option.removeprefix("--").replace("-", "_")


def _choices(config: type, field: str) -> tuple[str, ...] | None:
    """The values of the field's ``Literal`` type, or None for another type."""
    hint = get_type_hints(config)[field]
    return get_args(hint) if get_origin(hint) is Literal else None


def _has_option(parser: argparse.ArgumentParser, option: str) -> bool:
    return option in parser._option_string_actions


def add_muon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds megatron-muon's flags (and Megatron-LM's Muon flags where missing) to ``parser``."""
    group = parser.add_argument_group(title=_GROUP_TITLE)
    _add_megatron_muon_flags(parser, group)
    for field, kwargs in _FSDP_FLAGS.items():
        default = getattr(_FSDP_DEFAULTS, field)
        if field == "bucket_size_bytes":
            default = default / _MIB
        if choices := _choices(MuonFsdpConfig, field):
            kwargs = {**kwargs, "choices": choices}
        if not _has_option(parser, _option(field)):  # Megatron-LM main has --muon-use-syrk
            group.add_argument(_option(field), default=default, **kwargs)
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
            default=DEFAULT_ALPHA,
            help="QK-clip: the query side's share of a head's logit factor eta (queries scaled by "
            "eta^alpha, keys by eta^(1-alpha)), in (0, 1). Megatron-LM's flag and default.",
        )
    return parser


def _add_megatron_muon_flags(
    parser: argparse.ArgumentParser, group: argparse._ArgumentGroup
) -> None:
    """Megatron-LM's Muon flags, where missing: ``--optimizer`` and ``--muon-<field>`` per
    ``MuonConfig`` field (a bool defaulting to True as ``--muon-no-<field>``)."""
    if not _has_option(parser, "--optimizer"):
        group.add_argument(
            "--optimizer", type=str, default="adam", choices=get_args(MegatronOptimizerT)
        )
    hints = get_type_hints(MuonConfig)
    for field in fields(MuonConfig):
        name = field.name
        default = _MEGATRON_DEFAULTS.get(name, getattr(_MUON_DEFAULTS, name))
        option = "--muon-" + name.replace("_", "-")
        kwargs: dict[str, Any]
        if hints[name] is bool:
            action = "store_false" if default else "store_true"
            option = "--muon-no-" + name.replace("_", "-") if default else option
            kwargs = dict(action=action, dest=f"muon_{name}", default=default)
        else:
            choices = _MEGATRON_CHOICES.get(name) or _choices(MuonConfig, name)
            kind = str if choices else hints[name]
            kwargs = dict(type=kind, default=default, choices=choices)
        if not _has_option(parser, option):
            group.add_argument(option, **kwargs)


# --------------------------------------------------------------------------------------------------
# parsed flags -> configs
# --------------------------------------------------------------------------------------------------


def fsdp_config_from_args(args: argparse.Namespace) -> MuonFsdpConfig:
    """``MuonFsdpConfig`` from parsed ``add_muon_args`` flags (the field's default where a flag is
    absent).

    Raises:
        ValueError: a bad value; ``--muon-fsdp-bucket-size-mb`` named where it rounds to less
            than one byte.
    """
    values = {
        field: getattr(args, _dest(_option(field)))
        for field in _FSDP_FLAGS
        if hasattr(args, _dest(_option(field)))
    }
    bucket_mb = values.get("bucket_size_bytes")
    if bucket_mb is not None:
        values["bucket_size_bytes"] = int(bucket_mb * _MIB)
        if values["bucket_size_bytes"] < 1:
            raise ValueError(
                f"{_option('bucket_size_bytes')} must be positive (at least one byte), "
                f"got {bucket_mb}"
            )
    return MuonFsdpConfig(**values)


def _qk_clip_threshold(args: argparse.Namespace) -> float | None:
    """QK-clip's threshold from parsed args (unchecked), or None when QK-clip is off.

    Megatron-LM's arguments (they have ``--qk-clip``, a switch, and ``--qk-clip-threshold``,
    default 100): ``args.qk_clip_threshold`` if ``--qk-clip`` was given (or taken over by
    ``megatron_muon.integrations.megatron_lm_arguments`` as ``args.muon_qk_clip``), else None.
    Ours: ``--qk-clip-threshold`` as given (None = off).
    """
    if hasattr(args, "qk_clip") and not (args.qk_clip or getattr(args, "muon_qk_clip", False)):
        return None
    return getattr(args, "qk_clip_threshold", None)


def qk_clip_config_from_args(args: argparse.Namespace) -> QKClipConfig | None:
    """``QKClipConfig`` from parsed args (module docstring), or None when QK-clip is off.

    Raises:
        ValueError: a threshold or alpha that ``QKClipConfig`` refuses.
    """
    threshold = _qk_clip_threshold(args)
    if threshold is None:
        return None
    return QKClipConfig(threshold=threshold, alpha=getattr(args, "qk_clip_alpha", DEFAULT_ALPHA))


def check_muon_args(args: argparse.Namespace) -> None:
    """Checks the Muon flags' values as the configs built from them will, naming the flag.

    The rules are the configs' own (``MuonConfig``, ``NSConfig``, ``MuonFsdpConfig``,
    ``QKClipConfig``); run at argument validation, a bad value stops the run there with
    ``--flag VALUE: reason`` instead of failing at optimizer build with the config's field name.

    Raises:
        ValueError: the first flag whose value is refused.
    """
    # Unchecked flag values (Any): the configs below check them.
    steps: Any = getattr(args, "muon_num_ns_steps", _MUON_DEFAULTS.num_ns_steps)
    method: Any = getattr(args, _dest(_option("ns_method")), _FSDP_DEFAULTS.ns_method)
    half: Any = getattr(args, _dest(_option("gram_half_dtype")), _FSDP_DEFAULTS.gram_half_dtype)
    threshold = _qk_clip_threshold(args)
    # The NS flags first: MuonConfig checks its NS fields too, and would name --muon-momentum.
    checks = [
        ("--muon-num-ns-steps", "muon_num_ns_steps", lambda v: NSConfig(num_ns_steps=v)),
        (
            "--muon-coefficient-type",
            "muon_coefficient_type",
            lambda v: NSConfig(num_ns_steps=steps, coefficient_type=v),
        ),
        (
            _option("gram_restarts"),
            _dest(_option("gram_restarts")),
            lambda v: NSConfig(
                num_ns_steps=steps, ns_method=method, gram_restarts=v, gram_half_dtype=half
            ),
        ),
        ("--muon-momentum", "muon_momentum", lambda v: MuonConfig.from_optimizer_config(args)),
        (
            "--qk-clip-threshold",
            "qk_clip_threshold",
            lambda v: threshold is None or QKClipConfig(threshold=threshold),
        ),
        ("--qk-clip-alpha", "qk_clip_alpha", lambda v: qk_clip_config_from_args(args)),
    ]
    for flag, name, build in checks:
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        try:
            build(value)
        except ValueError as error:
            raise ValueError(f"{flag} {value}: {error}") from None
    fsdp_config_from_args(args)  # the megatron-muon flags, together; names the bucket flag

"""Command-line flags for Muon on Megatron-FSDP, in Megatron-LM's style, and the configs they give.

``add_muon_args(parser)`` has the shape of Megatron's ``extra_args_provider`` (takes a parser,
returns it). It adds

- megatron-muon's own flags, one per ``MuonFsdpConfig`` field with ``flag(...)`` metadata, derived
  from the field (``_fsdp_flag_kwargs``): the name ``--muon-<field>`` unless the metadata names
  another (``--muon-fsdp-mode``, ``--muon-fsdp-overlap-buckets``, ``--muon-fsdp-bucket-size-mb``),
  the field's default, its ``Literal`` values as choices (``megatron_muon.common.options``), its
  help; a field with a ``unit`` is a float flag in that unit (MiB for ``bucket_size_bytes``); and
- Megatron-LM's Muon flags (``--optimizer`` and ``--muon-<field>`` for each ``MuonConfig`` field)
  with Megatron-LM's names, choices and defaults, and ``--adaptive-muon-<field>`` for each
  ``AdaptiveMuonConfig`` field and ``--soap-<field>`` for each ``SoapConfig`` field
  (``OptimizerConfig.adaptive_muon_*``, ``soap_*``, which Megatron-LM 0.19.2's parser has no flag
  for), ``--psgd-pro-<field>`` and ``--rekls-<field>`` (``PsgdProConfig``, ``RekLsConfig``;
  ``SETTINGS_BEYOND_OPTIMIZER_CONFIG``: no ``OptimizerConfig`` field at all),
  **only where the parser lacks them**: on
  Megatron's own parser (``megatron.training.arguments``) they already exist and are left alone, so
  the same function serves Megatron-LM's loop and a parser of our own.

- ``--ckpt-trust-pickles`` (``load_checkpoint(..., trust_pickles=True)`` in Megatron-LM's
  loop): the one opt-out of the restricted unpickling of checkpoints
  (``megatron_muon.integrations.checkpoint_guards.pickles``).

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
from collections.abc import Mapping
from dataclasses import fields
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from megatron_muon.common.options import MegatronMatmulPrecT, MegatronOptimizerT
from megatron_muon.engine.config import MuonConfig, MuonFsdpConfig
from megatron_muon.fsdp.optimizer_registry import OPTIMIZERS
from megatron_muon.fsdp.qk_clip import QKClipConfig
from megatron_muon.fsdp.qk_clip_rows import DEFAULT_ALPHA
from megatron_muon.newton_schulz.methods import NSConfig
from megatron_muon.optimizers.adaptive_muon_config import AdaptiveMuonConfig
from megatron_muon.optimizers.soap_matrix import SoapConfig

__all__ = [
    "SETTINGS_BEYOND_OPTIMIZER_CONFIG",
    "add_muon_args",
    "add_optimizer_config_flags",
    "check_muon_args",
    "fsdp_config_from_args",
    "qk_clip_config_from_args",
    "settings_onto_config",
]

_GROUP_TITLE = "megatron-muon"
#: ``--optimizer`` -> the dataclass of its ``--<name>-<field>`` flags where megatron-core
#: 0.19.2's ``OptimizerConfig`` has no ``<name>_<field>`` (Megatron-LM leaves them on its args;
#: ``settings_onto_config`` carries them over; ``optimizers.settings.read_settings`` reads them).
SETTINGS_BEYOND_OPTIMIZER_CONFIG: dict[str, type] = {
    name: entry.settings
    for name, entry in OPTIMIZERS.items()
    # soap_*: OptimizerConfig's fields (``add_optimizer_config_flags`` below)
    if entry.kind in ("rowwise", "owner_computed")
    and entry.settings is not None
    and entry.settings is not SoapConfig
}
_FSDP_DEFAULTS = MuonFsdpConfig()
_MUON_DEFAULTS = MuonConfig()
# Our flags: the ``MuonFsdpConfig`` fields with ``flag(...)`` metadata (help, name, unit).
_FSDP_FLAGS: dict[str, Mapping[str, Any]] = {
    f.name: f.metadata for f in fields(MuonFsdpConfig) if "help" in f.metadata
}

# Where Megatron-LM's parser (core_r0.19.0 megatron/training/arguments.py) differs from the rule
# ``--muon-<field>``, ``MuonConfig``'s default and the field's Literal choices.
_MEGATRON_DEFAULTS = {"momentum": 0.9}  # OptimizerConfig's is 0.95, the parser's 0.9
_MEGATRON_CHOICES = {"fp32_matmul_prec": get_args(MegatronMatmulPrecT)}


def _option(field: str) -> str:
    """The flag of a ``MuonFsdpConfig`` field: its metadata's ``option``, else
    ``--muon-<field>``."""
    return _FSDP_FLAGS[field].get("option") or "--muon-" + field.replace("_", "-")


def _dest(option: str) -> str:
    """The flag's attribute on parsed args, as argparse names it (``--muon-ns-method``:
    ``muon_ns_method``)."""
    return option.removeprefix("--").replace("-", "_")


def _choices(config: type, field: str) -> tuple[str, ...] | None:
    """The values of the field's ``Literal`` type, or None for another type."""
    hint = get_type_hints(config)[field]
    return get_args(hint) if get_origin(hint) is Literal else None


def _fsdp_flag_kwargs(field: str) -> dict[str, Any]:
    """argparse's keywords for a ``MuonFsdpConfig`` field's flag, from the field's type, default
    and metadata: a ``Literal`` gives choices, ``bool`` an on/off pair (``--no-...``),
    ``tuple[int, ...]`` a list, a ``unit`` a float in that unit."""
    metadata = _FSDP_FLAGS[field]
    default = getattr(_FSDP_DEFAULTS, field)
    kwargs: dict[str, Any] = dict(help=metadata["help"], default=default)
    hint = get_type_hints(MuonFsdpConfig)[field]
    kinds = [kind for kind in get_args(hint) if kind is not type(None)] if get_args(hint) else []
    kind = kinds[0] if get_origin(hint) in (Union, UnionType) and len(kinds) == 1 else hint
    if metadata.get("unit"):
        kwargs.update(type=float, default=None if default is None else default / metadata["unit"])
    elif get_origin(kind) is Literal:
        kwargs.update(type=str, choices=get_args(kind))
    elif kind is bool:
        kwargs.update(action=argparse.BooleanOptionalAction)
    elif get_origin(kind) is tuple:
        kwargs.update(type=get_args(kind)[0], nargs="+")
    else:
        kwargs.update(type=kind)
    return kwargs


def _has_option(parser: argparse.ArgumentParser, option: str) -> bool:
    return option in parser._option_string_actions


def add_muon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds megatron-muon's flags (and Megatron-LM's Muon flags where missing) to ``parser``."""
    group = parser.add_argument_group(title=_GROUP_TITLE)
    _add_megatron_muon_flags(parser, group)
    for field in _FSDP_FLAGS:
        if not _has_option(parser, _option(field)):  # Megatron-LM main has --muon-use-syrk
            group.add_argument(_option(field), **_fsdp_flag_kwargs(field))
    if not _has_option(parser, "--ckpt-trust-pickles"):
        group.add_argument(
            "--ckpt-trust-pickles",
            action="store_true",
            help="Megatron reads checkpoints with its own, unrestricted readers (--load, "
            "--pretrained-checkpoint, --use-checkpoint-args, the RL reference load; any format): "
            "for a checkpoint you trust whose pickles hold types outside megatron-muon's "
            "allowlist, or whose format it does not check (legacy torch, local non-persistent); "
            "unpickling can run any code its writer chose. Default: at each of these, every "
            "pickle the reader Megatron picks from the files would read is read restricted first "
            "and another type is refused, naming the file and the type.",
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
            default=DEFAULT_ALPHA,
            help="QK-clip: the query side's share of a head's logit factor eta (queries scaled by "
            "eta^alpha, keys by eta^(1-alpha)), in (0, 1). Megatron-LM's flag and default.",
        )
    return parser


def _add_megatron_muon_flags(
    parser: argparse.ArgumentParser, group: argparse._ArgumentGroup
) -> None:
    """Megatron-LM's Muon flags, where missing: ``--optimizer``, ``--optimizer-switch-at-load``
    (ours), ``--muon-<field>`` per ``MuonConfig`` field, ``--adaptive-muon-<field>`` per
    ``AdaptiveMuonConfig`` field and ``--soap-<field>`` per ``SoapConfig`` field."""
    if not _has_option(parser, "--optimizer"):
        group.add_argument(
            "--optimizer", type=str, default="adam", choices=get_args(MegatronOptimizerT)
        )
    if not _has_option(parser, "--optimizer-switch-at-load"):
        _add_switch_flag(group)
    add_optimizer_config_flags(
        parser, group, MuonConfig, "muon", defaults=_MEGATRON_DEFAULTS, choices=_MEGATRON_CHOICES
    )
    # megatron-core's OptimizerConfig has adaptive_muon_*, Megatron-LM's parser no flag for them.
    add_optimizer_config_flags(parser, group, AdaptiveMuonConfig, "adaptive_muon")
    # Likewise soap_* (shampoo_beta, precondition_frequency, use_kl_shampoo).
    add_optimizer_config_flags(parser, group, SoapConfig, "soap")
    # laprop_*, ..., psgd_pro_*, rekls_*: no OptimizerConfig field (settings_onto_config).
    for name, settings in SETTINGS_BEYOND_OPTIMIZER_CONFIG.items():
        add_optimizer_config_flags(parser, group, settings, name)


def _add_switch_flag(group: argparse._ArgumentGroup) -> None:
    """``--optimizer-switch-at-load`` (``integrations.optimizer_switch``)."""
    group.add_argument(
        "--optimizer-switch-at-load",
        action="store_true",
        help="Let --load read an fsdp_dtensor checkpoint saved with another --optimizer (any two "
        "of --optimizer's choices), instead of refusing it: params on AdamW in both runs keep "
        "their AdamW state bit for bit (moments and step); state the new optimizer shares with "
        "the old one is carried bit for bit (Adam's exp_avg, Muon's momentum_buffer and Lion's "
        "exp_avg: the same average of the gradients, equal when their betas are; Adam's state "
        "whole or not at all); the rest starts fresh. The load logs what was carried and started "
        "fresh per pair of optimizers. Where the learning rate changes too, add "
        "--override-opt_param-scheduler (docs/checkpoints.md, 'Bring a run over').",
    )


def settings_onto_config(args: argparse.Namespace, config: Any) -> None:
    """Copies the ``--<name>-<field>`` flags of the optimizers whose settings megatron-core's
    ``OptimizerConfig`` has no field for (``SETTINGS_BEYOND_OPTIMIZER_CONFIG``) from Megatron's
    parsed ``args``
    onto ``config`` as ``<name>_<field>`` attributes, where ``config`` lacks them: Megatron-LM
    builds ``OptimizerConfig`` from its fields alone, and the classes read these attributes
    (megatron-core's rule for an emerging optimizer's keywords)."""
    for name, settings in SETTINGS_BEYOND_OPTIMIZER_CONFIG.items():
        for field in fields(settings):
            attribute = f"{name}_{field.name}"
            if hasattr(args, attribute) and not hasattr(config, attribute):
                setattr(config, attribute, getattr(args, attribute))


def add_optimizer_config_flags(
    parser: argparse.ArgumentParser,
    group: argparse._ArgumentGroup,
    config: type,
    prefix: str,
    *,
    defaults: Mapping[str, Any] | None = None,
    choices: Mapping[str, tuple[str, ...]] | None = None,
) -> None:
    """Flags for a dataclass mirroring ``OptimizerConfig.<prefix>_<field>`` fields, in
    Megatron-LM's style, each added only where ``parser`` lacks it.

    One flag per field: ``--<prefix>-<field>`` (dest ``<prefix>_<field>``, the name
    ``OptimizerConfig`` and ``from_optimizer_config`` read), the field's default (or
    ``defaults[field]``), its ``Literal`` values as choices (or ``choices[field]``); a bool
    defaulting to True is ``--<prefix>-no-<field>`` (``store_false``), as Megatron spells them;
    the help is the field's ``metadata["help"]`` where it has one.
    """
    hints = get_type_hints(config)
    base = config()
    dashed = prefix.replace("_", "-")
    for field in fields(config):
        name = field.name
        default = (defaults or {}).get(name, getattr(base, name))
        option = f"--{dashed}-" + name.replace("_", "-")
        kwargs: dict[str, Any]
        if hints[name] is bool:
            action = "store_false" if default else "store_true"
            option = f"--{dashed}-no-" + name.replace("_", "-") if default else option
            kwargs = dict(action=action, dest=f"{prefix}_{name}", default=default)
        else:
            allowed = (choices or {}).get(name) or _choices(config, name)
            kind = str if allowed else hints[name]
            kwargs = dict(type=kind, default=default, choices=allowed)
        if not _has_option(parser, option):
            group.add_argument(option, help=field.metadata.get("help"), **kwargs)


# --------------------------------------------------------------------------------------------------
# parsed flags -> configs
# --------------------------------------------------------------------------------------------------


def fsdp_config_from_args(args: argparse.Namespace) -> MuonFsdpConfig:
    """``MuonFsdpConfig`` from parsed ``add_muon_args`` flags (the field's default where a flag is
    absent).

    Raises:
        ValueError: a bad value; a flag with a unit (``--muon-fsdp-bucket-size-mb``) named where
            it rounds to less than one (byte).
    """
    values = {}
    for field, metadata in _FSDP_FLAGS.items():
        dest = _dest(_option(field))
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if metadata.get("unit") and value is not None:
            value, flagged = int(value * metadata["unit"]), value
            if value < 1:
                raise ValueError(
                    f"{_option(field)} must be positive (at least one {field} unit), got {flagged}"
                )
        values[field] = value
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
    try:
        fsdp_config_from_args(args)  # the megatron-muon flags, together; names a flag with a unit
    except ValueError as error:  # MuonFsdpConfig's messages start with the field's name
        field = str(error).split(" ", 1)[0]
        if field not in _FSDP_FLAGS:
            raise
        option = _option(field)
        raise ValueError(f"{option} {getattr(args, _dest(option))}: {error}") from None

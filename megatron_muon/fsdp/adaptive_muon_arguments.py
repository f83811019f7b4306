"""``--adaptive-muon-*`` flags: one per ``AdaptiveMuonConfig`` field, derived from the dataclass.

megatron-core 0.19.2's ``OptimizerConfig`` has ``adaptive_muon_moment2_method``,
``adaptive_muon_beta2`` and ``adaptive_muon_eps`` but Megatron-LM's parser has no flag for them.
``add_adaptive_muon_args(parser)`` adds ``--adaptive-muon-<field>`` for each field of
``AdaptiveMuonConfig`` that the parser lacks (its default the field's, its choices the field's
``Literal`` values), so Megatron's ``get_megatron_optimizer_config`` (which copies every args
attribute named after an ``OptimizerConfig`` field) carries them into the config.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from megatron_muon.sharded.adaptive_muon import AdaptiveMuonConfig

__all__ = ["add_adaptive_muon_args"]

_HELP = {
    "moment2_method": "--optimizer adaptive_muon: the second moment applied to the raw "
    "Newton-Schulz result: 'adamuon' elementwise, 'normuon' per row or column, 'namo' a "
    "Frobenius-norm ratio.",
    "beta2": "--optimizer adaptive_muon: decay of the second moment's running average, in [0, 1).",
    "eps": "--optimizer adaptive_muon: the second moment's epsilon.",
}
assert set(_HELP) == {f.name for f in fields(AdaptiveMuonConfig)}, "a flag per field"


def add_adaptive_muon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``--adaptive-muon-*`` flags ``parser`` lacks; returns it."""
    group = parser.add_argument_group(title="megatron-muon adaptive_muon")
    hints = get_type_hints(AdaptiveMuonConfig)
    for field in fields(AdaptiveMuonConfig):
        option = "--adaptive-muon-" + field.name.replace("_", "-")
        if option in parser._option_string_actions:
            continue
        hint = hints[field.name]
        kwargs: dict[str, Any]
        if get_origin(hint) is Literal:
            kwargs = dict(type=str, choices=get_args(hint))
        else:
            kwargs = dict(type=hint)
        group.add_argument(option, default=field.default, help=_HELP[field.name], **kwargs)
    return parser

"""The pretrain entry point's command line: its own flags, its parser and ``--config`` YAML files.

``python -m megatron_muon.pretrain`` parses Megatron-LM's flags (``megatron.training.arguments``),
megatron-muon's (``megatron_muon.fsdp.arguments``) and the few of its own added here (``--config``,
``--text-path``, ``--log-json``, ``--plot``, ``--no-use-megatron-fsdp``). ``--config`` names a YAML
file of Megatron flag names, applied before the command line, which wins.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_muon.cli.pretrain_defaults import add_opt_out_flags

__all__ = ["add_pretrain_args", "parser", "config_flags", "config_path"]


def add_pretrain_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This entry point's own flags (Megatron's and megatron-muon's come from ``install()``)."""
    group = parser.add_argument_group(title="megatron-muon pretrain")
    group.add_argument(
        "--config",
        type=str,
        default=None,
        help="YAML whose keys (in any top-level section) are Megatron flag names with "
        "underscores; they are applied before the command line's flags, which win.",
    )
    group.add_argument(
        "--text-path",
        type=str,
        default=None,
        help="A text file to train on as byte tokens (default: the Python standard library's "
        "sources). Ignored with --mock-data or --data-path (Megatron indexed datasets).",
    )
    group.add_argument("--log-json", type=str, default=None, help="Write the run's log here.")
    group.add_argument(
        "--plot", type=str, default=None, help="Write a PNG of the loss curves here (rank 0)."
    )
    return add_opt_out_flags(parser)


# --------------------------------------------------------------------------------------------------
# --config
# --------------------------------------------------------------------------------------------------

# Keys of the project's configs that describe a run but are no Megatron flag.
_DESCRIPTIVE_KEYS = frozenset({"name", "default_ep", "default_tp", "default_pp"})
# TransformerConfig names that Megatron's parser spells differently.
_FLAG_ALIASES = {"gated_linear_unit": "swiglu"}


def parser() -> argparse.ArgumentParser:
    """Megatron's parser with megatron-muon's and this entry point's flags (as the run parses,
    ``install()``'s ``parse_args``: its help's bare ``%`` escaped, so that ``--help`` works)."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_muon.integrations.megatron_lm_arguments import (
        escape_bare_percent_in_help,
        extra_args_provider,
    )

    megatron = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return escape_bare_percent_in_help(add_pretrain_args(extra_args_provider(megatron)))


def config_flags(path: str | Path) -> list[str]:
    """Megatron flags from a YAML config: ``{section: {flag_name: value}}`` or flat.

    ``true`` gives a bare flag, ``false`` its ``--no-`` form where Megatron (or this entry point)
    has one (``use_megatron_fsdp: false`` -> ``--no-use-megatron-fsdp``), else nothing; ``null``
    leaves it out; lists become Megatron's bracketed strings (``moe_layer_freq: [0, 1]`` ->
    ``--moe-layer-freq [0,1]``).

    Raises:
        ValueError: the file is not a mapping, or a key is no flag of Megatron's, ours or this
            entry point's.
    """
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(
            f"--config {path}: expected a mapping of flag names (or of sections of them), got a "
            f"{type(data).__name__}"
        )
    items: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            items.update(value)
        else:
            items[key] = value
    options = parser()._option_string_actions
    flags: list[str] = []
    unknown = []
    for key, value in items.items():
        option = "--" + _FLAG_ALIASES.get(key, key).replace("_", "-")
        if key in _DESCRIPTIVE_KEYS:
            continue
        if option not in options:
            unknown.append(key)
            continue
        if value is True:
            flags.append(option)
        elif value is False:
            negative = "--no-" + option[2:]
            flags += [negative] if negative in options else []
        elif value is None:
            continue
        elif isinstance(value, list):
            flags += [option, "[" + ",".join(str(v) for v in value) + "]"]
        else:
            flags += [option, str(value)]
    if unknown:
        raise ValueError(f"{path}: {sorted(unknown)} are not Megatron flags")
    return flags


def config_path(flags: Sequence[str]) -> str | None:
    """The file ``--config`` names in ``flags``, or None."""
    for index, flag in enumerate(flags):
        if flag == "--config" and index + 1 < len(flags):
            return flags[index + 1]
        if flag.startswith("--config="):
            return flag.split("=", 1)[1]
    return None

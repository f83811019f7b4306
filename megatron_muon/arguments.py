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
- ``--muon-fsdp-bucket-size-mb`` (None = one bucket): bound on the fp32 full matrices exchanged at
  once, i.e. the step's peak extra memory.
- ``--muon-ns-method {standard,gram}`` (standard): Newton-Schulz or Gram Newton-Schulz.
- ``--muon-offload-momentum``: keep Muon momentum in CPU memory between steps.

``sharded_muon_kwargs(args)`` turns parsed args into those keywords.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_muon_args", "sharded_muon_kwargs", "FSDP_MODES", "NS_METHODS"]

FSDP_MODES = ("owner", "gather")
NS_METHODS = ("standard", "gram")
_GROUP_TITLE = "megatron-muon"


def _has_option(parser: argparse.ArgumentParser, option: str) -> bool:
    return option in parser._option_string_actions


def add_muon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds megatron-muon's flags (and Megatron-LM's Muon flags where missing) to ``parser``."""
    group = parser.add_argument_group(title=_GROUP_TITLE)
    _add_megatron_muon_flags(parser, group)
    group.add_argument(
        "--muon-fsdp-mode",
        choices=FSDP_MODES,
        default="owner",
        help="Where Newton-Schulz runs on Megatron-FSDP shards: 'owner' orthogonalizes each full "
        "matrix once, on one owner rank (NS work ~ 1/DP per rank); 'gather' on every rank.",
    )
    group.add_argument(
        "--muon-fsdp-bucket-size-mb",
        type=float,
        default=None,
        help="Bound (MiB of fp32) on the full matrices exchanged at once for Newton-Schulz; "
        "default: all matrices in one bucket.",
    )
    group.add_argument(
        "--muon-ns-method",
        choices=NS_METHODS,
        default="standard",
        help="Newton-Schulz iteration: 'standard' or 'gram' (Gram Newton-Schulz).",
    )
    group.add_argument(
        "--muon-offload-momentum",
        action="store_true",
        help="Keep Muon momentum in CPU memory between optimizer steps.",
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
            dict(
                type=str, default="spectral", choices=["spectral", "unit_rms_norm", "shape_scaling"]
            ),
        ),
        (
            "--muon-fp32-matmul-prec",
            dict(type=str, default="medium", choices=["low", "medium", "high"]),
        ),
        ("--muon-coefficient-type", dict(type=str, default="quintic")),
        ("--muon-num-ns-steps", dict(type=int, default=5)),
        (
            "--muon-tp-mode",
            dict(type=str, default="blockwise", choices=["blockwise", "duplicated", "distributed"]),
        ),
        ("--muon-extra-scale-factor", dict(type=float, default=1.0)),
        ("--muon-scalar-optimizer", dict(type=str, default="adam", choices=["adam", "lion"])),
    ]
    for option, kwargs in flags:
        if not _has_option(parser, option):
            group.add_argument(option, **kwargs)


def sharded_muon_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ShardedMuon`` keywords that megatron-muon's flags set (defaults where absent)."""
    bucket_mb = getattr(args, "muon_fsdp_bucket_size_mb", None)
    if bucket_mb is not None and bucket_mb <= 0:
        raise ValueError(f"--muon-fsdp-bucket-size-mb must be positive, got {bucket_mb}")
    return {
        "mode": getattr(args, "muon_fsdp_mode", "owner"),
        "bucket_size_bytes": None if bucket_mb is None else int(bucket_mb * 2**20),
        "ns_method": getattr(args, "muon_ns_method", "standard"),
        "offload_momentum": bool(getattr(args, "muon_offload_momentum", False)),
    }

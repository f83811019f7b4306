"""Configuration of Muon on Megatron-FSDP: Megatron's own ``muon_*`` flags, plus ours.

Two frozen dataclasses, one per concern, each the single validator of its fields:

- ``MuonConfig``: the Muon hyper-parameters exactly as megatron-core's ``OptimizerConfig`` names
  them (field ``x`` <-> ``OptimizerConfig.muon_x`` <-> ``--muon-x``), read with
  ``MuonConfig.from_optimizer_config(config)``. Their meaning is that of megatron-core
  ``TensorParallelMuon``'s constructor arguments of the same names (which ``ShardedMuon`` takes).
- ``MuonFsdpConfig``: what only megatron-muon has (where Newton-Schulz runs on Megatron-FSDP's row
  shards, exchange bucketing, NS method, momentum offload), one field per ``ShardedMuon`` keyword
  and per ``megatron_muon.fsdp.arguments`` flag (``--muon-fsdp-mode`` ...), plus QK-clip's threshold
  (``--qk-clip-threshold``; the factory builds a ``QKClip`` that the step wrapper runs), read from
  parsed flags with ``MuonFsdpConfig.from_args(args)``.

The Newton-Schulz fields of both (steps, scale mode, NS method, Gram settings) are checked by
``newton_schulz.NSConfig``; the allowed values of every string option are the ``Literal`` aliases
of ``megatron_muon.common.options`` (and the NS-method registry). ``ShardedMuon`` builds all three
from its
keywords, so a bad value is refused by the same code whichever way it comes in. Learning rate,
weight decay, Adam/Lion betas, clipping and precision stay in ``OptimizerConfig``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from megatron_muon.common.options import (
    FsdpModeT,
    GramHalfDtypeT,
    MuonScaleT,
    ScalarOptimizerT,
    TpModeT,
    check_choice,
)
from megatron_muon.newton_schulz.methods import NSConfig, NSMethodT

__all__ = [
    "DEFAULT_BUCKET_SIZE_BYTES",
    "DEFAULT_QK_CLIP_ALPHA",
    "MuonConfig",
    "MuonFsdpConfig",
    "qk_clip_threshold",
]

# The default bound on the fp32 full matrices an owner step holds at once: on the benchmark's
# dense model at DP=2 the smallest bucket whose step is within 5% of one bucket's time
# (docs/benchmarks.md, "Exchange bucket size").
DEFAULT_BUCKET_SIZE_BYTES = 16 * 2**20
# megatron-core's TransformerConfig.qk_clip_alpha and Megatron-LM's --qk-clip-alpha default.
DEFAULT_QK_CLIP_ALPHA = 0.5

# ``MuonFsdpConfig`` field <- the ``megatron_muon.fsdp.arguments`` flag's attribute on parsed args.
_FLAG_ATTRIBUTES = {
    "mode": "muon_fsdp_mode",
    "ns_method": "muon_ns_method",
    "gram_half_dtype": "muon_gram_half_dtype",
    "gram_restarts": "muon_gram_restarts",
    "offload_momentum": "muon_offload_momentum",
    "overlap_buckets": "muon_fsdp_overlap_buckets",
    "qk_clip_alpha": "qk_clip_alpha",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class MuonConfig:
    """Megatron's Muon flags (``OptimizerConfig.muon_*``), same names without the prefix.

    Defaults are ``OptimizerConfig``'s (megatron-core 0.19.2), not ``TensorParallelMuon``'s: e.g.
    ``nesterov=False`` and ``tp_mode="blockwise"``.
    """

    momentum: float = 0.95
    split_qkv: bool = True
    nesterov: bool = False
    scale_mode: MuonScaleT = "spectral"
    fp32_matmul_prec: str = "medium"
    coefficient_type: str = "quintic"
    num_ns_steps: int = 5
    tp_mode: TpModeT = "blockwise"
    extra_scale_factor: float = 1.0
    scalar_optimizer: ScalarOptimizerT = "adam"

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        # coefficient_type is left to ShardedMuon's NSConfig: "custom" needs the triples, which
        # Megatron's flags do not carry.
        NSConfig(num_ns_steps=self.num_ns_steps, scale_mode=self.scale_mode)
        check_choice("tp_mode", self.tp_mode, TpModeT)
        check_choice("scalar_optimizer", self.scalar_optimizer, ScalarOptimizerT)

    @classmethod
    def from_optimizer_config(cls, config: Any) -> MuonConfig:
        """Reads ``config.muon_<field>`` for every field (megatron-core ``OptimizerConfig``, or
        Megatron's parsed args, which carry the same names).

        Raises:
            ValueError: naming the ``muon_`` field read (``muon_momentum must be in [0, 1) ...``).
        """
        values = {f.name: getattr(config, f"muon_{f.name}") for f in fields(cls)}
        try:
            return cls(**values)
        except ValueError as error:  # every message starts with the field's name
            raise ValueError(f"muon_{error}") from None

    def tensor_parallel_muon_kwargs(self) -> dict[str, Any]:
        """The ``TensorParallelMuon`` / ``ShardedMuon`` keywords these flags set.

        Weight decay is always decoupled for Muon in Megatron (``use_decoupled_weight_decay``
        keeps its default, True); lr and weight_decay come from ``OptimizerConfig`` separately.
        """
        return {
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "split_qkv": self.split_qkv,
            "fp32_matmul_prec": self.fp32_matmul_prec,
            "coefficient_type": self.coefficient_type,
            "num_ns_steps": self.num_ns_steps,
            "scale_mode": self.scale_mode,
            "extra_scale_factor": self.extra_scale_factor,
            "tp_mode": self.tp_mode,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class MuonFsdpConfig:
    """megatron-muon's own settings for Muon on Megatron-FSDP shards (``ShardedMuon`` keywords).

    Attributes:
        mode: ``"owner"``: each full matrix is orthogonalized once, on one owner rank of the
            data-parallel group; ``"gather"``: every rank gathers and orthogonalizes every matrix.
        bucket_size_bytes: bound on the fp32 full matrices one rank holds at once (the owner
            step's peak extra memory; ``DEFAULT_BUCKET_SIZE_BYTES``); None = all in one bucket.
        ns_method: ``"standard"`` Newton-Schulz, ``"gram"`` (Gram Newton-Schulz) or
            ``"symmetric"`` (``newton_schulz.symmetric``).
        gram_half_dtype: Gram NS's matmul dtype under ``muon_fp32_matmul_prec="medium"``
            (``"float16"`` or ``"bfloat16"``; fp32 under "high"/"highest").
        gram_restarts: Gram NS restart iterations (None: ``default_gram_restarts``).
        offload_momentum: keep Muon momentum in CPU memory between steps.
        overlap_buckets: owner mode: exchange bucket k+1 while bucket k runs NS (two buckets'
            full matrices held at once instead of one; bitwise the same updates).
        qk_clip_threshold: MuonClip's ``tau`` (``megatron_muon.fsdp.qk_clip.QKClip``) applied to
        every
            megatron-core ``SelfAttention`` and ``MultiLatentAttention`` of the model after each
            step; None = off. Not a
            ``ShardedMuon`` keyword: the factory builds the ``QKClip`` and the step wrapper runs it.
        qk_clip_alpha: the query side's share of each clipped head's factor ``eta`` (queries
            ``eta^alpha``, keys ``eta^(1 - alpha)``; ``--qk-clip-alpha``), in (0, 1) when QK-clip
            is on.
    """

    mode: FsdpModeT = "owner"
    bucket_size_bytes: int | None = DEFAULT_BUCKET_SIZE_BYTES
    ns_method: NSMethodT = "standard"
    gram_half_dtype: GramHalfDtypeT = "float16"
    gram_restarts: tuple[int, ...] | None = None
    offload_momentum: bool = False
    overlap_buckets: bool = False
    qk_clip_threshold: float | None = None
    qk_clip_alpha: float = DEFAULT_QK_CLIP_ALPHA

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, FsdpModeT)
        if self.bucket_size_bytes is not None and self.bucket_size_bytes <= 0:
            raise ValueError(f"bucket_size_bytes must be positive, got {self.bucket_size_bytes}")
        # Gram restarts are checked where the number of NS steps is known (ShardedMuon's NSConfig).
        NSConfig(ns_method=self.ns_method, gram_half_dtype=self.gram_half_dtype)
        if self.gram_restarts is not None:
            # Lists (argparse nargs, YAML) become tuples, so the frozen config stays hashable.
            object.__setattr__(self, "gram_restarts", tuple(self.gram_restarts))
        if self.qk_clip_threshold is not None and not self.qk_clip_threshold > 0:
            raise ValueError(
                f"qk_clip_threshold must be positive (None: off), got {self.qk_clip_threshold}"
            )
        if self.qk_clip_threshold is not None and not 0 < self.qk_clip_alpha < 1:
            # Megatron-LM's rule for --qk-clip-alpha (checked only when QK-clip is on).
            raise ValueError(f"qk_clip_alpha must be in (0, 1), got {self.qk_clip_alpha}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MuonFsdpConfig:
        """From parsed ``megatron_muon.fsdp.arguments`` flags (the field's default where a flag is
        absent).

        Raises:
            ValueError: a bad value; ``--muon-fsdp-bucket-size-mb`` named where it rounds to less
                than one byte.
        """
        values = {
            field: getattr(args, attribute)
            for field, attribute in _FLAG_ATTRIBUTES.items()
            if hasattr(args, attribute)
        }
        bucket_mb = getattr(args, "muon_fsdp_bucket_size_mb", None)
        if bucket_mb is not None:
            values["bucket_size_bytes"] = int(bucket_mb * 2**20)
            if values["bucket_size_bytes"] < 1:
                raise ValueError(
                    "--muon-fsdp-bucket-size-mb must be positive (at least one byte), "
                    f"got {bucket_mb}"
                )
        return cls(**values, qk_clip_threshold=qk_clip_threshold(args))

    def sharded_muon_kwargs(self) -> dict[str, Any]:
        """The ``ShardedMuon`` keyword-only arguments these settings set."""
        return {
            "mode": self.mode,
            "bucket_size_bytes": self.bucket_size_bytes,
            "ns_method": self.ns_method,
            "gram_half_dtype": self.gram_half_dtype,
            "gram_restarts": self.gram_restarts,
            "offload_momentum": self.offload_momentum,
            "overlap_buckets": self.overlap_buckets,
        }


def qk_clip_threshold(args: argparse.Namespace) -> float | None:
    """QK-clip's threshold from parsed args, or None when QK-clip is off.

    Megatron-LM's arguments (they have ``--qk-clip``, a switch, and ``--qk-clip-threshold``,
    default 100): ``args.qk_clip_threshold`` if ``--qk-clip`` was given (or taken over by
    ``megatron_muon.integrations.megatron_lm`` as ``args.muon_qk_clip``), else None. Ours
    (``megatron_muon.fsdp.arguments``): ``--qk-clip-threshold`` as given (None = off). The value is
    checked by ``MuonFsdpConfig``.
    """
    if hasattr(args, "qk_clip") and not (args.qk_clip or getattr(args, "muon_qk_clip", False)):
        return None
    return getattr(args, "qk_clip_threshold", None)

"""Configuration of Muon on Megatron-FSDP: Megatron's own ``muon_*`` flags, plus ours.

Two frozen dataclasses, one per concern:

- ``MuonConfig``: the Muon hyper-parameters exactly as megatron-core's ``OptimizerConfig`` names
  them (field ``x`` <-> ``OptimizerConfig.muon_x`` <-> ``--muon-x``), read with
  ``MuonConfig.from_optimizer_config(config)``. Their meaning is ``TensorParallelMuon``'s
  (REFERENCE.md section 4).
- ``MuonFsdpConfig``: what only megatron-muon has (where Newton-Schulz runs on Megatron-FSDP's row
  shards, exchange bucketing, NS method, momentum offload), one field per ``ShardedMuon`` keyword
  and per ``megatron_muon.arguments`` flag (``--muon-fsdp-mode`` ...), plus QK-clip's threshold
  (``--qk-clip-threshold``; the factory builds a ``QKClip`` that the step wrapper runs).

Learning rate, weight decay, Adam/Lion betas, clipping and precision stay in ``OptimizerConfig``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = ["MuonConfig", "MuonFsdpConfig", "TpModeT", "ScalarOptimizerT", "GramHalfDtypeT"]

TpModeT = Literal["blockwise", "duplicated", "distributed"]
ScalarOptimizerT = Literal["adam", "lion"]
FsdpModeT = Literal["owner", "gather"]
NSMethodT = Literal["standard", "gram"]
GramHalfDtypeT = Literal["float16", "bfloat16"]

_TP_MODES = ("blockwise", "duplicated", "distributed")
_SCALAR_OPTIMIZERS = ("adam", "lion")
_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")


@dataclass(frozen=True, kw_only=True, slots=True)
class MuonConfig:
    """Megatron's Muon flags (``OptimizerConfig.muon_*``), same names without the prefix.

    Defaults are ``OptimizerConfig``'s (megatron-core 0.19.2), not ``TensorParallelMuon``'s: e.g.
    ``nesterov=False`` and ``tp_mode="blockwise"``.
    """

    momentum: float = 0.95
    split_qkv: bool = True
    nesterov: bool = False
    scale_mode: str = "spectral"
    fp32_matmul_prec: str = "medium"
    coefficient_type: str = "quintic"
    num_ns_steps: int = 5
    tp_mode: TpModeT = "blockwise"
    extra_scale_factor: float = 1.0
    scalar_optimizer: ScalarOptimizerT = "adam"

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"muon_momentum must be in [0, 1), got {self.momentum}")
        if self.num_ns_steps < 1:
            raise ValueError(f"muon_num_ns_steps must be at least 1, got {self.num_ns_steps}")
        if self.tp_mode not in _TP_MODES:
            raise ValueError(f"muon_tp_mode must be one of {_TP_MODES}, got {self.tp_mode!r}")
        if self.scale_mode not in _SCALE_MODES:
            raise ValueError(
                f"muon_scale_mode must be one of {_SCALE_MODES}, got {self.scale_mode!r}"
            )
        if self.scalar_optimizer not in _SCALAR_OPTIMIZERS:
            raise ValueError(
                f"muon_scalar_optimizer must be one of {_SCALAR_OPTIMIZERS}, "
                f"got {self.scalar_optimizer!r}"
            )

    @classmethod
    def from_optimizer_config(cls, config: Any) -> MuonConfig:
        """Reads ``config.muon_<field>`` for every field (megatron-core ``OptimizerConfig``)."""
        return cls(**{f.name: getattr(config, f"muon_{f.name}") for f in fields(cls)})

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
        bucket_size_bytes: bound on the fp32 full matrices exchanged at once (peak extra memory);
            None = all in one bucket.
        ns_method: ``"standard"`` Newton-Schulz or ``"gram"`` (Gram Newton-Schulz).
        gram_half_dtype: Gram NS's matmul dtype under ``muon_fp32_matmul_prec="medium"``
            (``"float16"`` or ``"bfloat16"``; fp32 under "high"/"highest").
        gram_restarts: Gram NS restart iterations (None: ``default_gram_restarts``).
        offload_momentum: keep Muon momentum in CPU memory between steps.
        qk_clip_threshold: MuonClip's ``tau`` (``megatron_muon.qk_clip.QKClip``) applied to every
            megatron-core ``SelfAttention`` of the model after each step; None = off. Not a
            ``ShardedMuon`` keyword: the factory builds the ``QKClip`` and the step wrapper runs it.
    """

    mode: FsdpModeT = "owner"
    bucket_size_bytes: int | None = None
    ns_method: NSMethodT = "standard"
    gram_half_dtype: GramHalfDtypeT = "float16"
    gram_restarts: tuple[int, ...] | None = None
    offload_momentum: bool = False
    qk_clip_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("owner", "gather"):
            raise ValueError(f"fsdp mode must be 'owner' or 'gather', got {self.mode!r}")
        if self.bucket_size_bytes is not None and self.bucket_size_bytes <= 0:
            raise ValueError(f"bucket_size_bytes must be positive, got {self.bucket_size_bytes}")
        if self.ns_method not in ("standard", "gram"):
            raise ValueError(f"ns_method must be 'standard' or 'gram', got {self.ns_method!r}")
        if self.gram_half_dtype not in ("float16", "bfloat16"):
            raise ValueError(
                f"gram_half_dtype must be 'float16' or 'bfloat16', got {self.gram_half_dtype!r}"
            )
        if self.gram_restarts is not None:
            # Lists (argparse nargs, YAML) become tuples, so the frozen config stays hashable.
            object.__setattr__(self, "gram_restarts", tuple(self.gram_restarts))
        if self.qk_clip_threshold is not None and not self.qk_clip_threshold > 0:
            raise ValueError(
                f"qk_clip_threshold must be positive (None: off), got {self.qk_clip_threshold}"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MuonFsdpConfig:
        """From parsed ``megatron_muon.arguments`` flags (defaults where a flag is absent)."""
        from megatron_muon.arguments import qk_clip_threshold, sharded_muon_kwargs

        return cls(**sharded_muon_kwargs(args), qk_clip_threshold=qk_clip_threshold(args))

    def sharded_muon_kwargs(self) -> dict[str, Any]:
        """The ``ShardedMuon`` keyword-only arguments these settings set."""
        return {
            "mode": self.mode,
            "bucket_size_bytes": self.bucket_size_bytes,
            "ns_method": self.ns_method,
            "gram_half_dtype": self.gram_half_dtype,
            "gram_restarts": self.gram_restarts,
            "offload_momentum": self.offload_momentum,
        }

"""Configuration of Muon on Megatron-FSDP: Megatron's own ``muon_*`` flags, plus ours.

Two frozen dataclasses, one per concern, each the single validator of its fields:

- ``MuonConfig``: the Muon hyper-parameters exactly as megatron-core's ``OptimizerConfig`` names
  them (field ``x`` <-> ``OptimizerConfig.muon_x`` <-> ``--muon-x``), read with
  ``MuonConfig.from_optimizer_config(config)``. Their meaning is that of megatron-core
  ``TensorParallelMuon``'s constructor arguments of the same names (which ``ShardedMuon`` takes).
- ``MuonFsdpConfig``: what only megatron-muon has (where Newton-Schulz runs on Megatron-FSDP's row
  shards, exchange bucketing, NS method, momentum offload), one field per ``ShardedMuon`` keyword
  (``sharded_muon_kwargs()``) and per ``megatron_muon.fsdp.arguments`` flag (``--muon-fsdp-mode``
  ...; ``fsdp.arguments.fsdp_config_from_args`` reads parsed flags).

The Newton-Schulz fields of both (steps, scale mode, NS method, Gram settings) are checked by
``newton_schulz.NSConfig``, whose defaults ``MuonFsdpConfig``'s NS fields take; the allowed values
of every string option are the ``Literal`` aliases of ``megatron_muon.common.options`` (and the
NS-method registry). ``ShardedMuon`` builds all three from its keywords, so a bad value is refused
by the same code whichever way it comes in. Learning rate, weight decay, Adam/Lion betas, clipping
and precision stay in ``OptimizerConfig``; QK-clip (MuonClip), which the factory builds around the
optimizer, is ``megatron_muon.fsdp.qk_clip.QKClipConfig``.
"""

from __future__ import annotations

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
from megatron_muon.newton_schulz.syrk import syrk_problem

__all__ = ["DEFAULT_BUCKET_SIZE_BYTES", "MuonConfig", "MuonFsdpConfig"]

# The default budget for the fp32 full matrices (and staged rows) an owner step holds at once. The
# buckets hold the least memory among the cuts whose critical path is within 3% of the shortest
# (``bucket_schedule.bucket_by_schedule``), so the budget is spent only where it shortens the
# step. Measured on the sequential bucket model at real shapes (``python -m megatron_muon.plan``):
# 4 GiB keeps every exact TP mode's critical path within 1.05x of its NS spread evenly on
# llama3-70b (DP 16 x TP 8 layer_sharded: 1.046; a full FC1 is 1.75 GiB there, so 16 MiB gave
# 1.596 and 1 GiB 1.435) and deepseek-v3 (DP 64 x TP 2, EP 8: 1.001, 1.5 GiB peak), and costs
# nothing where small buckets suffice (llama3-8b, the CPU bench's hidden-512 matrices).
DEFAULT_BUCKET_SIZE_BYTES = 4 * 2**30
# The NS defaults (method, Gram dtype) are NSConfig's.
_NS_DEFAULTS = NSConfig()


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
        """The ``TensorParallelMuon`` / ``ShardedMuon`` keywords these flags set: every field but
        ``scalar_optimizer`` (the factory's), under its own name.

        Weight decay is always decoupled for Muon in Megatron (``use_decoupled_weight_decay``
        keeps its default, True); lr and weight_decay come from ``OptimizerConfig`` separately.
        """
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "scalar_optimizer"}


@dataclass(frozen=True, kw_only=True, slots=True)
class MuonFsdpConfig:
    """megatron-muon's own settings for Muon on Megatron-FSDP shards (``ShardedMuon`` keywords).

    Attributes:
        mode: ``"owner"``: each full matrix is orthogonalized once, on one owner rank of the
            data-parallel group; ``"gather"``: every rank gathers and orthogonalizes every matrix.
        bucket_size_bytes: bound on the fp32 full matrices one rank holds at once (the owner
            step's peak extra memory; ``DEFAULT_BUCKET_SIZE_BYTES``), spent only where it
            shortens the step's critical path; None = all in one bucket.
        ns_method: ``"standard"`` Newton-Schulz, ``"gram"`` (Gram Newton-Schulz) or
            ``"symmetric"`` (``newton_schulz.symmetric``).
        gram_half_dtype: Gram NS's matmul dtype under ``muon_fp32_matmul_prec="medium"``
            (``"float16"`` or ``"bfloat16"``; fp32 under "high"/"highest").
        gram_restarts: Gram NS restart iterations (None: ``default_gram_restarts``).
        offload_momentum: keep Muon momentum in CPU memory between steps.
        overlap_buckets: owner mode: exchange bucket k+1 while bucket k runs NS (two buckets'
            full matrices held at once instead of one; bitwise the same updates).
        use_syrk: run the standard NS through emerging-optimizers' Triton syrk kernels
            (Megatron-LM main's ``--muon-use-syrk``; ``newton_schulz.syrk``): CUDA only, refused
            here by name where it cannot run (``syrk_problem``). The optimizer reads it into its
            ``NSConfig(use_syrk=...)``, not as a ``ShardedMuon`` keyword.
    """

    mode: FsdpModeT = "owner"
    bucket_size_bytes: int | None = DEFAULT_BUCKET_SIZE_BYTES
    ns_method: NSMethodT = _NS_DEFAULTS.ns_method
    gram_half_dtype: GramHalfDtypeT = _NS_DEFAULTS.gram_half_dtype
    gram_restarts: tuple[int, ...] | None = _NS_DEFAULTS.gram_restarts
    offload_momentum: bool = False
    overlap_buckets: bool = False
    use_syrk: bool = False

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, FsdpModeT)
        if self.bucket_size_bytes is not None and self.bucket_size_bytes <= 0:
            raise ValueError(f"bucket_size_bytes must be positive, got {self.bucket_size_bytes}")
        # Gram restarts are checked where the number of NS steps is known (ShardedMuon's NSConfig).
        NSConfig(
            ns_method=self.ns_method, gram_half_dtype=self.gram_half_dtype, use_syrk=self.use_syrk
        )
        if self.use_syrk and (problem := syrk_problem()) is not None:
            raise ValueError(f"use_syrk (--muon-use-syrk) cannot run here: {problem}")
        if self.gram_restarts is not None:
            # Lists (argparse nargs, YAML) become tuples, so the frozen config stays hashable.
            object.__setattr__(self, "gram_restarts", tuple(self.gram_restarts))

    def sharded_muon_kwargs(self) -> dict[str, Any]:
        """The ``ShardedMuon`` keyword-only arguments these settings set: every field but
        ``use_syrk`` (which goes into the optimizer's ``NSConfig``), under its own name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "use_syrk"}

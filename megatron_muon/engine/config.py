"""Configuration of Muon on Megatron-FSDP: Megatron's own ``muon_*`` flags, plus ours.

Two frozen dataclasses, one per concern, each the single definition and validator of its fields;
``ShardedMuon(params, lr=..., weight_decay=..., muon=MuonConfig(...), fsdp=MuonFsdpConfig(...))``
takes them as they are:

- ``MuonConfig``: the Muon hyper-parameters exactly as megatron-core's ``OptimizerConfig`` names
  them (field ``x`` <-> ``OptimizerConfig.muon_x`` <-> ``--muon-x``), read with
  ``MuonConfig.from_optimizer_config(config)``. Their meaning is that of megatron-core
  ``TensorParallelMuon``'s constructor arguments of the same names
  (``tensor_parallel_muon_kwargs()``, what ``ShardedMuon`` hands its base class).
- ``MuonFsdpConfig``: what only megatron-muon has (where Newton-Schulz runs on Megatron-FSDP's row
  shards, exchange bucketing, NS method, momentum offload, ...). A field with ``flag(...)`` metadata
  is a command-line flag (``megatron_muon.fsdp.arguments`` derives name, type, choices, default and
  help from the field; ``fsdp_config_from_args`` reads parsed flags back), so a new setting is one
  field here plus the code that reads ``optimizer.fsdp_config.<field>``.

The Newton-Schulz fields of both (steps, scale mode, NS method, Gram settings) are checked by
``newton_schulz.NSConfig``: each config its own fields, ``MuonFsdpConfig.ns_config(muon)`` the
combination (the ``NSConfig`` ``ShardedMuon`` runs). The allowed values of every string option are
the ``Literal`` aliases of ``megatron_muon.common.options`` (and the NS-method registry). Learning
rate, weight decay, Adam/Lion betas, clipping and precision stay in ``OptimizerConfig``; QK-clip
(MuonClip), which the factory builds around the optimizer, is
``megatron_muon.fsdp.qk_clip.QKClipConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from megatron_muon.common.options import (
    FsdpModeT,
    GramHalfDtypeT,
    MuonScaleT,
    ScalarOptimizerT,
    TpModeT,
    check_choice,
)
from megatron_muon.engine.planner import MIN_SPLIT_FLOPS
from megatron_muon.newton_schulz.methods import NSConfig, NSMethodT
from megatron_muon.newton_schulz.syrk import syrk_problem

__all__ = ["DEFAULT_BUCKET_SIZE_BYTES", "MuonConfig", "MuonFsdpConfig", "flag"]

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
        # coefficient_type is checked by MuonFsdpConfig.ns_config: "custom" needs the triples
        # (MuonFsdpConfig.custom_coefficient_sets), which Megatron's flags do not carry.
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
        """The ``TensorParallelMuon`` keywords these flags set (``ShardedMuon`` passes them to its
        base class): every field but ``scalar_optimizer`` (the factory's), under its own name.

        Weight decay is always decoupled for Muon in Megatron (``use_decoupled_weight_decay``
        keeps its default, True); lr and weight_decay come from ``OptimizerConfig`` separately.
        """
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "scalar_optimizer"}


def flag(help: str, *, option: str | None = None, unit: int | None = None) -> dict[str, Any]:
    """A ``MuonFsdpConfig`` field's metadata: its command-line flag (``fsdp.arguments`` adds one per
    field that has this metadata; fields without it have no flag).

    Args:
        help: the flag's help text (argparse ``%`` rules: a literal ``%`` is ``%%``).
        option: the flag's name; default ``--muon-<field with dashes>``.
        unit: the field's value is the flag's times ``unit`` (the flag a float: MiB for bytes).
    """
    return {"help": help, "option": option, "unit": unit}


@dataclass(frozen=True, kw_only=True, slots=True)
class MuonFsdpConfig:
    """megatron-muon's own settings for Muon on Megatron-FSDP shards (``ShardedMuon(fsdp=...)``).

    One field per setting: its type (a ``Literal`` alias gives the flag's choices), default,
    validation (``__post_init__``) and flag (``flag(...)`` metadata: help, name) are here, and
    ``fsdp.arguments`` derives the flag from them; ``ShardedMuon`` reads the field at run time.

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
        min_split_flops: a matrix whose NS costs at least this many FLOPs may have its NS split
            over a small block of ranks when one owner per matrix cannot balance the load
            (``planner.plan_split_owners``; ``MIN_SPLIT_FLOPS``); ``0`` allows splitting any.
            Under tp_mode layer_sharded a split TP-split matrix's update is exact to the
            reduction order, not bitwise ``duplicated``'s (``tp_grid``).
        custom_coefficient_sets: the NS ``(a, b, c)`` triples for
            ``MuonConfig.coefficient_type="custom"`` (no flag: Megatron's flags carry none).
        use_syrk: run the standard NS through emerging-optimizers' Triton syrk kernels
            (Megatron-LM main's ``--muon-use-syrk``; ``newton_schulz.syrk``): CUDA only, refused
            here by name where it cannot run (``syrk_problem``). Read into the
            optimizer's ``NSConfig(use_syrk=...)`` (``ns_config``).
    """

    mode: FsdpModeT = field(
        default="owner",
        metadata=flag(
            "Where Newton-Schulz runs on Megatron-FSDP shards: 'owner' orthogonalizes each full "
            "matrix once, on one owner rank (NS work ~ 1/DP per rank); 'gather' on every rank.",
            option="--muon-fsdp-mode",
        ),
    )
    bucket_size_bytes: int | None = field(
        default=DEFAULT_BUCKET_SIZE_BYTES,
        metadata=flag(
            "Bound (MiB of fp32) on the full matrices one rank holds at once for Newton-Schulz "
            "(matrices are exchanged and orthogonalized bucket by bucket); a bound above the "
            "model's matrices gives one bucket.",
            option="--muon-fsdp-bucket-size-mb",
            unit=2**20,
        ),
    )
    ns_method: NSMethodT = field(
        default=_NS_DEFAULTS.ns_method,
        metadata=flag(
            "Newton-Schulz iteration: 'standard' (megatron-core's), 'gram' (Gram Newton-Schulz) "
            "or 'symmetric' (the standard iteration, its symmetric products by halves: 12-17%% "
            "fewer FLOPs; never split over ranks)."
        ),
    )
    gram_half_dtype: GramHalfDtypeT = field(
        default=_NS_DEFAULTS.gram_half_dtype,
        metadata=flag(
            "Gram Newton-Schulz matmul dtype under --muon-fp32-matmul-prec medium (fp32 under "
            "high/highest). bfloat16 where fp16 matmuls are slow (CPUs)."
        ),
    )
    gram_restarts: tuple[int, ...] | None = field(
        default=_NS_DEFAULTS.gram_restarts,
        metadata=flag(
            "Gram Newton-Schulz: iterations after which X and X X^T are rebuilt (each in "
            "[1, --muon-num-ns-steps), increasing); default: the method's own for the dtype."
        ),
    )
    offload_momentum: bool = field(
        default=False,
        metadata=flag("Keep Muon momentum in CPU memory between optimizer steps."),
    )
    overlap_buckets: bool = field(
        default=False,
        metadata=flag(
            "Owner mode: exchange the next bucket while this one runs Newton-Schulz "
            "(two buckets' full matrices held at once; the same updates).",
            option="--muon-fsdp-overlap-buckets",
        ),
    )
    min_split_flops: int = field(
        default=MIN_SPLIT_FLOPS,
        metadata=flag(
            "Owner mode: a matrix whose Newton-Schulz costs at least this many FLOPs may be "
            "split over a few ranks when one owner per matrix cannot balance the load; 0 allows "
            "splitting any matrix."
        ),
    )
    custom_coefficient_sets: tuple[tuple[float, float, float], ...] | None = None
    use_syrk: bool = field(
        default=False,
        metadata=flag(
            "Run the standard Newton-Schulz iteration through emerging-optimizers' Triton syrk "
            "kernels (Megatron-LM main's flag): CUDA GPUs of SM 8.0/9.0/10.x with Triton >= 3.4, "
            "bf16 iteration (--muon-fp32-matmul-prec medium); refused elsewhere."
        ),
    )

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, FsdpModeT)
        if self.bucket_size_bytes is not None and self.bucket_size_bytes <= 0:
            raise ValueError(f"bucket_size_bytes must be positive, got {self.bucket_size_bytes}")
        if self.min_split_flops < 0:
            raise ValueError(f"min_split_flops must be >= 0, got {self.min_split_flops}")
        # Gram restarts and custom coefficients are checked with the number of NS steps and the
        # coefficient type (``ns_config``).
        NSConfig(
            ns_method=self.ns_method, gram_half_dtype=self.gram_half_dtype, use_syrk=self.use_syrk
        )
        if self.use_syrk and (problem := syrk_problem()) is not None:
            raise ValueError(f"use_syrk (--muon-use-syrk) cannot run here: {problem}")
        # Lists (argparse nargs, YAML) become tuples, so the frozen config stays hashable.
        if self.gram_restarts is not None:
            object.__setattr__(self, "gram_restarts", tuple(self.gram_restarts))
        if self.custom_coefficient_sets is not None:
            triples = tuple(tuple(triple) for triple in self.custom_coefficient_sets)
            object.__setattr__(self, "custom_coefficient_sets", triples)

    def ns_config(self, muon: MuonConfig) -> NSConfig:
        """The Newton-Schulz config of ``muon``'s NS fields with these NS settings.

        Raises:
            ValueError: settings that only conflict together (Gram restarts beyond
                ``muon.num_ns_steps``, custom triples without ``coefficient_type="custom"``, a
                custom type without triples, an unknown coefficient type).
        """
        return NSConfig(
            num_ns_steps=muon.num_ns_steps,
            coefficient_type=muon.coefficient_type,
            scale_mode=muon.scale_mode,
            extra_scale_factor=muon.extra_scale_factor,
            ns_method=self.ns_method,
            custom_coefficient_sets=self.custom_coefficient_sets,
            gram_restarts=self.gram_restarts,
            gram_half_dtype=self.gram_half_dtype,
            use_syrk=self.use_syrk,
        )

"""What a conversion carries, by model-space param name: the format between the two formats.

``ModelSpace`` holds global tensors only (no rank, no shard): what ``torch_dist`` and
``fsdp_dtensor`` both are underneath. Each format's module reads one into it and writes one from it
(``convert.torch_dist``, ``convert.fsdp_dtensor``); ``ConversionRefused`` names what cannot map.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "ADAM_STATE",
    "CARRIED_OPTIMIZERS",
    "MUON_STATE",
    "ConversionRefused",
    "ModelSpace",
    "check_source_args",
    "group_by_weight_decay",
    "refuse_unless",
]

# The --optimizer values whose state both formats hold alike (per param, elementwise): Adam, and
# Muon (its matrices' momentum; AdamW's state for the rest).
CARRIED_OPTIMIZERS = ("adam", "muon")
# Adam's per-param state (torch.optim.Adam/AdamW), besides its step.
ADAM_STATE = ("exp_avg", "exp_avg_sq")
# Muon's per-matrix state (megatron-core's TensorParallelMuon and ours): no step.
MUON_STATE = ("momentum_buffer",)
_STATE_SETS = (set(ADAM_STATE), set(MUON_STATE))
# A param megatron-core's Muon orthogonalizes (2-D, no is_embedding_or_output_parameter) and ours
# gives AdamW: the learned absolute position embedding.
_ROUTED_APART = "embedding.position_embeddings.weight"


class ConversionRefused(ValueError):
    """The source checkpoint holds a layout or state with no counterpart in the target format;
    the message names it. Nothing is written."""


@dataclass
class ModelSpace:
    """One checkpoint as global tensors by model-space name (``convert.names``).

    Attributes:
        params: name -> the fp32 weights (the optimizer's main params where the source has them).
        state: name -> {``exp_avg``, ``exp_avg_sq``}: Adam's moments, or {``momentum_buffer``}:
            Muon's momentum of a matrix; each the param's global shape.
        steps: name -> Adam's step count (the same for every param of a group); Muon's matrices
            have none.
        groups: name -> the param's group fields (lr, betas, wd_mult, ...; no ``params``, no
            ``step``), as megatron-core's optimizer saves them.
        scheduler: ``OptimizerParamScheduler.state_dict()``.
        args: Megatron's ``args`` as saved, to be rewritten for the target format.
        iteration, flops, checkpoint_version: Megatron's counters as saved.
        notes: what the conversion did beyond copying (one line each, for the summary).
    """

    params: dict[str, torch.Tensor]
    state: dict[str, dict[str, torch.Tensor]]
    steps: dict[str, float]
    groups: dict[str, dict[str, Any]]
    scheduler: dict[str, Any]
    args: argparse.Namespace
    iteration: int
    flops: float
    checkpoint_version: float
    notes: list[str] = field(default_factory=list)

    @property
    def transformer_impl(self) -> str:
        return str(getattr(self.args, "transformer_impl", "transformer_engine"))

    @property
    def swiglu(self) -> bool:
        return bool(getattr(self.args, "swiglu", False))

    @property
    def optimizer(self) -> str:
        return str(getattr(self.args, "optimizer", None))

    def check(self) -> None:
        """Every param has its state and group, each with Adam's state its step, each state
        tensor its param's shape; a Muon run's matrices are those both Muons route to Muon.

        Raises:
            ConversionRefused: naming the first params that lack one, or the param routed apart.
        """
        adam = {n for n, state in self.state.items() if set(state) == set(ADAM_STATE)}
        for what, table, needed in (
            ("state", self.state, set(self.params)),
            ("step", self.steps, adam),
            ("group", self.groups, set(self.params)),
        ):
            if missing := sorted(needed - set(table)):
                raise ConversionRefused(f"no optimizer {what} for {missing[:5]} ({len(missing)})")
        if odd := sorted(n for n, s in self.state.items() if set(s) not in _STATE_SETS):
            raise ConversionRefused(f"optimizer state {sorted(self.state[odd[0]])} of {odd[0]}")
        refuse_unless(
            self.optimizer != "muon" or _ROUTED_APART not in self.params,
            f"{_ROUTED_APART}: megatron-core's Muon orthogonalizes the learned position "
            "embedding, ours runs it on AdamW: no counterpart either way (train with "
            "--position-embedding-type rope)",
        )
        for name, state in self.state.items():
            for kind, tensor in state.items():
                if tensor.shape != self.params[name].shape:
                    raise ConversionRefused(
                        f"{name}'s {kind} has shape {tuple(tensor.shape)}, the param "
                        f"{tuple(self.params[name].shape)}: not a model-space state"
                    )


def refuse_unless(condition: bool, reason: str) -> None:
    """Raises ``ConversionRefused(reason)`` unless ``condition``."""
    if not condition:
        raise ConversionRefused(reason)


def check_source_args(args: argparse.Namespace, source: str) -> None:
    """The layouts neither format's reader maps, refused by name (from Megatron's ``args``).

    Raises:
        ConversionRefused: naming the flag.
    """
    refuse_unless(
        getattr(args, "optimizer", None) in CARRIED_OPTIMIZERS,
        f"{source}: --optimizer {getattr(args, 'optimizer', None)}: only the state of "
        f"{list(CARRIED_OPTIMIZERS)} is converted",
    )
    refuse_unless(
        getattr(args, "pipeline_model_parallel_size", 1) == 1,
        f"{source}: --pipeline-model-parallel-size {args.pipeline_model_parallel_size}: pipeline "
        "parallelism is not supported (Megatron-FSDP in megatron-core 0.19.2 cannot wrap a stage)",
    )
    refuse_unless(
        not getattr(args, "num_experts", None),
        f"{source}: --num-experts {getattr(args, 'num_experts', None)}: MoE expert tensors are "
        "not mapped by this converter",
    )
    refuse_unless(
        not getattr(args, "multi_latent_attention", False),
        f"{source}: --multi-latent-attention: its fused norms' names are not mapped",
    )
    refuse_unless(
        not (getattr(args, "bf16", False) or getattr(args, "fp16", False)),
        f"{source}: --bf16/--fp16: low-precision params (the two formats' weights of such a "
        "run differ in dtype and were not measured here)",
    )
    refuse_unless(
        getattr(args, "decoupled_lr", None) is None
        and not getattr(args, "apply_wd_to_qk_layernorm", False),
        f"{source}: --decoupled-lr / --apply-wd-to-qk-layernorm: param groups beyond "
        "megatron-core's default weight-decay split cannot be told apart in torch_dist",
    )


def group_by_weight_decay(groups: list[dict[str, Any]], source: str) -> dict[bool, dict[str, Any]]:
    """{no weight decay: the group}: megatron-core's default split, the only one told apart."""
    by_rule: dict[bool, dict[str, Any]] = {}
    for group in groups:
        key = float(group.get("wd_mult", 1.0)) == 0.0
        refuse_unless(
            key not in by_rule and float(group.get("lr_mult", 1.0)) == 1.0,
            f"{source}: param groups beyond megatron-core's default weight-decay split "
            f"({len(groups)} groups, wd_mult/lr_mult "
            f"{[(g.get('wd_mult'), g.get('lr_mult')) for g in groups]})",
        )
        by_rule[key] = group
    return by_rule

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
    "ConversionRefused",
    "ModelSpace",
    "check_source_args",
    "refuse_unless",
]

# The --optimizer values whose state both formats hold alike (per param, elementwise).
CARRIED_OPTIMIZERS = ("adam",)
# Adam's per-param state (torch.optim.Adam/AdamW), besides its step.
ADAM_STATE = ("exp_avg", "exp_avg_sq")


class ConversionRefused(ValueError):
    """The source checkpoint holds a layout or state with no counterpart in the target format;
    the message names it. Nothing is written."""


@dataclass
class ModelSpace:
    """One checkpoint as global tensors by model-space name (``convert.names``).

    Attributes:
        params: name -> the fp32 weights (the optimizer's main params where the source has them).
        state: name -> {``exp_avg``, ``exp_avg_sq``}: Adam's moments, the param's global shape.
        steps: name -> Adam's step count (the same for every param of a group).
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

    def check(self) -> None:
        """Every param has its state, step and group, and each state tensor its param's shape.

        Raises:
            ConversionRefused: naming the first params that lack one.
        """
        for what, table in (("state", self.state), ("step", self.steps), ("group", self.groups)):
            if missing := sorted(set(self.params) - set(table)):
                raise ConversionRefused(f"no optimizer {what} for {missing[:5]} ({len(missing)})")
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
        f"{list(CARRIED_OPTIMIZERS)} is converted (megatron-core's Muon under "
        "LayerWiseDistributedOptimizer, and our Muon's momentum, are not mapped yet)",
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

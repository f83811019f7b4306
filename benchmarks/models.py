"""What the benchmarks optimize: a small transformer's weight shapes, and Megatron-FSDP row shards.

The optimizer-step benchmarks need only the 2-D weights Muon orthogonalizes, laid out over the
data-parallel group exactly as Megatron-FSDP lays them out. ``ShapeModel`` holds parameters of the
given shapes, one module per transformer layer, and ``shard_like_megatron_fsdp`` wraps it with
``megatron_fsdp.fully_shard_model`` (``optim_grads_params``, one FSDP unit per layer): each layer's
weights form one flat buffer cut into DP equal parts at row boundaries, so most weights sit on one
or two ranks and the rest are split unevenly, as in training. The training-step benchmarks build a
megatron-core ``GPTModel`` of a ``GPTSize`` (``benchmarks.training_step``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "GPTSize",
    "TransformerShapes",
    "ShapeModel",
    "ShapeLayer",
    "shard_like_megatron_fsdp",
]


@dataclass(frozen=True, slots=True)
class TransformerShapes:
    """The Muon weights of a GPT-style transformer (no embeddings, norms or biases).

    Attributes:
        num_layers: transformer layers.
        hidden: model width.
        ffn_hidden: MLP width (per expert when ``num_experts > 0``).
        num_experts: 0 for a dense MLP; else each layer has a router ``(E, hidden)`` and ``E``
            experts with their own fc1 ``(ffn, hidden)`` and fc2 ``(hidden, ffn)`` (Megatron's
            SequentialMLP / grouped-GEMM ``weight{i}`` layout: one 2-D param per expert).
    """

    num_layers: int
    hidden: int
    ffn_hidden: int
    num_experts: int = 0

    def layer_shapes(self) -> list[tuple[int, int]]:
        """(out, in) of each Muon weight of one layer, in Megatron's module order."""
        h, f = self.hidden, self.ffn_hidden
        attention = [(3 * h, h), (h, h)]  # linear_qkv, linear_proj
        if self.num_experts == 0:
            return attention + [(f, h), (h, f)]
        return attention + [(self.num_experts, h)] + [(f, h), (h, f)] * self.num_experts

    def shapes(self) -> list[tuple[int, int]]:
        return self.layer_shapes() * self.num_layers

    def num_params(self) -> int:
        return sum(rows * cols for rows, cols in self.shapes())

    def describe(self) -> str:
        moe = f", {self.num_experts} experts" if self.num_experts else ""
        return (
            f"{self.num_layers} layers, hidden {self.hidden}, "
            f"{'expert ' if self.num_experts else ''}MLP {self.ffn_hidden}{moe}"
        )


@dataclass(frozen=True, slots=True)
class GPTSize:
    """GPTModel size and the tokens each rank processes per step."""

    num_layers: int
    hidden: int
    ffn_hidden: int
    num_heads: int
    vocab_size: int
    seq_length: int
    micro_batch: int

    def tokens_per_rank(self) -> int:
        return self.seq_length * self.micro_batch


class ShapeLayer(nn.Module):
    """One transformer layer's weights (the FSDP unit); no forward is needed."""

    def __init__(self, shapes: list[tuple[int, int]], generator: torch.Generator) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(*shape, generator=generator) / shape[1] ** 0.5)
            for shape in shapes
        )


class ShapeModel(nn.Module):
    """``num_layers`` ``ShapeLayer``s with a transformer's Muon weight shapes."""

    def __init__(self, shapes: TransformerShapes, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(
            ShapeLayer(shapes.layer_shapes(), generator) for _ in range(shapes.num_layers)
        )


def shard_like_megatron_fsdp(model: nn.Module, world_size: int, device: torch.device) -> nn.Module:
    """Wraps ``model`` with ``megatron_fsdp.fully_shard_model`` (optim_grads_params, unit = layer).

    Returns the wrapped model; its ``parameters()`` are the optimizer's ``Shard(0)`` DTensors.
    """
    import megatron_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size, 1), mesh_dim_names=("fsdp", "tp"))
    return megatron_fsdp.fully_shard_model(
        model,
        device_mesh=mesh,
        dp_shard_dim="fsdp",
        tp_dim="tp",
        device=device,
        zero_dp_strategy="optim_grads_params",
        fsdp_unit_modules=[ShapeLayer],
    )

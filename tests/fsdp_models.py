"""Small models and Megatron-FSDP wrapping helpers shared by the distributed tests (in ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# Megatron-FSDP's data-parallel sharding strategies (``--data-parallel-sharding-strategy``), in the
# order of what they shard: nothing, optimizer state, + gradients, + params.
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class ToyMLP(nn.Module):
    """Two linears whose shapes give uneven (and, on 3 ranks, empty) Megatron-FSDP row splits."""

    def __init__(self, dim: int = 16, hidden: int = 48) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def fully_shard_toy(model: nn.Module, world_size: int, strategy: str) -> nn.Module:
    """Wraps ``model`` with ``megatron_fsdp.fully_shard_model`` on a CPU (fsdp, tp) mesh."""
    import megatron_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("fsdp", "tp"))
    kwargs = {}
    if strategy == "optim_grads_params":
        kwargs["fsdp_unit_modules"] = [nn.Linear]
    return megatron_fsdp.fully_shard_model(
        model,
        device_mesh=mesh,
        dp_shard_dim="fsdp",
        tp_dim="tp",
        device=torch.device("cpu"),
        zero_dp_strategy=strategy,
        **kwargs,
    )


def hsdp_shard_toy(module: nn.Module, outer: str) -> tuple[nn.Module, dist.ProcessGroup]:
    """megatron_fsdp HSDP on 4 ranks: a (2 outer x 2 fsdp) mesh, inner optim_grads_params; outer
    ``optim`` shards rows over both dims (``(Shard(0), Shard(0))``), rank order unlike row order.
    Returns the wrapped module and the 4-rank group the rows are sharded over."""
    import megatron_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("outer", "fsdp", "tp"))
    hsdp_group = mesh["outer", "fsdp"]._flatten("hsdp").get_group()
    wrapped = megatron_fsdp.fully_shard_model(
        module,
        device_mesh=mesh,
        dp_shard_dim="fsdp",
        dp_outer_dim="outer",
        tp_dim="tp",
        hybrid_fsdp_group=hsdp_group,
        device=torch.device("cpu"),
        zero_dp_strategy="optim_grads_params",
        outer_dp_sharding_strategy=outer,
        fsdp_unit_modules=[nn.Linear],
    )
    return wrapped, hsdp_group


class AttentionModel(nn.Module):
    """An attention layer as a model Megatron-FSDP can wrap (``forward(x, mask)``)."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.attention(x, attention_mask=mask)[0]


def fully_shard_attention(
    attention: nn.Module, world_size: int, strategy: str, unit: type[nn.Module]
) -> nn.Module:
    """``AttentionModel(attention)`` wrapped by ``megatron_fsdp.fully_shard_model`` on a CPU
    (fsdp, tp) mesh, ``unit`` (the attention's class) as the FSDP unit."""
    import megatron_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("fsdp", "tp"))
    return megatron_fsdp.fully_shard_model(
        AttentionModel(attention),
        device_mesh=mesh,
        dp_shard_dim="fsdp",
        tp_dim="tp",
        device=torch.device("cpu"),
        zero_dp_strategy=strategy,
        fsdp_unit_modules=[unit],
    )

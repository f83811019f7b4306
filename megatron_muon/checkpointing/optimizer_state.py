"""Optimizer state for every param on every rank, created without an optimizer step.

**Rank-symmetric state.** Every rank must hold state for every param of its optimizers before a
save or a load. torch's Adam/AdamW (and emerging-optimizers' Muon and Lion) create state lazily, on
a param's first step with a gradient, and under Megatron-FSDP a rank holding 0 rows of a param has
``grad is None`` and never creates it. The ranks' state keys then differ: megatron_fsdp's
``preprocess_state_dict_for_uneven_dtensor`` runs one ``all_gather_object`` per DTensor, so
Megatron's ``fsdp_dtensor`` save falls out of step and hangs (seen with stock Megatron-LM and
``--optimizer adam`` at DP=2), and here such a rank's rows of that state would go unwritten.

**Without a step.** A zero-grad "dummy" step (megatron-core's ``DistributedOptimizer`` does one
on checkpoint load, megatron_fsdp's ``fully_shard_optimizer`` a similar one) would create the
state but also apply decoupled weight decay, shrinking the weights. State is created as the
optimizer's own first step creates it: emerging-optimizers' ``_init_group(group,
skip_non_grad_params=False)``, and for torch ``Adam``/``AdamW`` the tensors of
``Adam._init_group`` (zero moments like the param; a 0-d ``step``).

**The real step count.** Adam's per-param ``step`` is then set to its maximum over the param's
data-parallel mesh: the ranks holding rows of the param stepped it, a rank with 0 rows never did,
and DCP keeps one rank's copy of such a replicated value.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_muon.checkpointing.ranks import collective_device
from megatron_muon.engine.owner_compute import OwnerComputedOptimizer
from megatron_muon.optimizers.laprop import ShardedLaProp
from megatron_muon.optimizers.muon import ShardedMuon
from megatron_muon.optimizers.oblique import ShardedObliqueAdam, ShardedObliqueSGD
from megatron_muon.optimizers.soap_matrix import STATE_KEYS

__all__ = [
    "create_state",
    "creates_state",
    "ensure_optimizer_state",
    "expected_state_keys",
    "leaf_optimizers",
]


def leaf_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The ``torch.optim.Optimizer`` objects holding the state, in order.

    Accepts a torch optimizer, a list/tuple of them, megatron-core's ``ChainedOptimizer`` and any
    ``MegatronOptimizer`` wrapping one in ``.optimizer`` (``FP32Optimizer``, the FSDP step wrapper).
    """
    from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer

    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if isinstance(optimizer, (list, tuple)):
        return [leaf for child in optimizer for leaf in leaf_optimizers(child)]
    if isinstance(optimizer, ChainedOptimizer):
        return [leaf for child in optimizer.chained_optimizers for leaf in leaf_optimizers(child)]
    if isinstance(optimizer, MegatronOptimizer):
        return leaf_optimizers(optimizer.optimizer)
    raise TypeError(
        f"cannot find the torch optimizers inside {type(optimizer).__name__}: pass a "
        "torch.optim.Optimizer, a list of them, or a megatron-core (Chained)MegatronOptimizer"
    )


def _emerging_optimizer_classes() -> tuple[type[Any], type[Any], type[Any]]:
    from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer
    from emerging_optimizers.scalar_optimizers import Lion
    from emerging_optimizers.soap import SOAP

    return OrthogonalizedOptimizer, Lion, SOAP


# Optimizers that name their state (``state_keys``) and create it with ``_init_group``.
_NAMING_THEIR_STATE = (ShardedLaProp, ShardedObliqueSGD, ShardedObliqueAdam)


def _is_adaptive_muon(optimizer: torch.optim.Optimizer) -> bool:
    from emerging_optimizers.orthogonalized_optimizers import AdaptiveMuon

    return isinstance(optimizer, AdaptiveMuon)


def expected_state_keys(optimizer: torch.optim.Optimizer, group: dict) -> tuple[str, ...]:
    """State keys every param of ``group`` holds once the optimizer has state for it."""
    orthogonalized, lion, soap = _emerging_optimizer_classes()
    if isinstance(optimizer, OwnerComputedOptimizer):  # ShardedSOAP, ShardedPSGDPro, ...
        return optimizer.STATE_KEYS
    if isinstance(optimizer, _NAMING_THEIR_STATE):
        return optimizer.state_keys
    if isinstance(optimizer, soap):  # SOAP, ShardedSOAP (whose tensors live on each owner)
        return STATE_KEYS
    if _is_adaptive_muon(optimizer):  # AdaptiveMuon, megatron-core's, ShardedAdaptiveMuon
        return ("momentum_buffer", "moment2_buffer")
    if isinstance(optimizer, orthogonalized):  # Muon, TensorParallelMuon, ShardedMuon
        return ("momentum_buffer",)
    if isinstance(optimizer, lion):
        return ("exp_avg",)
    if isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        keys = ("step", "exp_avg", "exp_avg_sq")
        return (*keys, "max_exp_avg_sq") if group.get("amsgrad", False) else keys
    if isinstance(optimizer, torch.optim.SGD):  # a buffer only with momentum
        return ("momentum_buffer",) if group["momentum"] != 0 else ()
    raise TypeError(
        f"checkpointing does not know how {type(optimizer).__name__} creates its state without a "
        "step; supported: Muon (emerging_optimizers OrthogonalizedOptimizer, ShardedMuon), "
        "emerging_optimizers Lion and SOAP, the owner-computed ones (ShardedSOAP, ShardedREKLS, "
        "ShardedPSGDPro), torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD"
    )


def creates_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``create_state`` knows how ``optimizer`` creates its state (Muon, Lion and SOAP of
    emerging-optimizers, ``ShardedMuon``, the owner-computed ``ShardedSOAP``, ``ShardedREKLS`` and
    ``ShardedPSGDPro``, the row-wise ones, torch ``Adam``/``AdamW``/``SGD``)."""
    classes = (
        torch.optim.Adam,
        torch.optim.SGD,
        OwnerComputedOptimizer,
        *_emerging_optimizer_classes(),
    )
    return isinstance(optimizer, (*classes, *_NAMING_THEIR_STATE))


@torch.no_grad()
def create_state(optimizer: torch.optim.Optimizer) -> None:
    """Every param's missing state, as ``optimizer``'s own first step creates it, without a step.

    Local: no collective (Adam's ``step`` is 0 here; ``ensure_optimizer_state`` makes it the real
    count). Momentum and moments are zeros like their param (a DTensor like a DTensor param).

    Raises:
        TypeError: ``creates_state(optimizer)`` is False.
        RuntimeError: a param holds some of its state keys but not all.
    """
    for group in optimizer.param_groups:
        keys = expected_state_keys(optimizer, group)
        for param in group["params"]:
            state = optimizer.state[param]
            if not state:
                _create_param_state(optimizer, group, param)
            missing = [k for k in keys if k not in state]
            if missing:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds partial state for a param of shape "
                    f"{tuple(param.shape)}: {sorted(state)} lacks {missing}"
                )


def _create_param_state(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> None:
    """The state ``optimizer`` creates lazily on its first step, created now (zeros, step 0)."""
    known = (OwnerComputedOptimizer, *_emerging_optimizer_classes(), *_NAMING_THEIR_STATE)
    if isinstance(optimizer, known):
        # emerging_optimizers' own lazy init (or ours, alike), for params without a grad too.
        optimizer._init_group(group, skip_non_grad_params=False)
        return
    if isinstance(optimizer, torch.optim.SGD):
        # torch's SGD sets its buffer to the first gradient; a zero buffer gives the same bits
        # (0 * momentum + grad, with dampening 0 as megatron-core builds it).
        if group["momentum"] != 0:
            optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)
        return
    # torch.optim.Adam._init_group, without taking a step: ``step`` is fp32 when fused, else
    # fp64 under a fp64 default dtype (torch's ``_get_scalar_dtype``); on the param's device when
    # capturable or fused, else on the CPU.
    state = optimizer.state[param]
    default = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    if group["capturable"] or group["fused"]:
        dtype = torch.float32 if group["fused"] else default
        state["step"] = torch.zeros((), dtype=dtype, device=param.device)
    else:
        state["step"] = torch.tensor(0.0, dtype=default, device="cpu")
    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _param_process_groups(param: torch.Tensor) -> list[dist.ProcessGroup]:
    """The groups of the param's mesh dims (data-parallel replicas, shards); none if plain."""
    if not isinstance(param, DTensor):
        return []
    mesh = param.device_mesh
    return [mesh.get_group(dim) for dim in range(mesh.ndim)]


@torch.no_grad()
def ensure_optimizer_state(optimizer: Any) -> None:
    """Creates the missing state of every param of every leaf optimizer, without stepping
    (``create_state``), and makes Adam's ``step`` counts the real ones.

    Collective: every rank of each param's data-parallel mesh must call it. Adam's per-param
    ``step`` (a plain 0-d tensor, replicated) is then set to its maximum over the param's mesh: the
    ranks holding rows of the param all stepped it, while a rank with 0 rows (``grad is None``)
    never did. Momentum and moments are DTensors like their param (global shape, placements).
    """
    stepped: dict[tuple[int, ...], list[torch.Tensor]] = {}
    mesh_groups: dict[tuple[int, ...], list[dist.ProcessGroup]] = {}
    for leaf in leaf_optimizers(optimizer):
        if isinstance(leaf, ShardedMuon):
            # Offloaded momentum has its storage freed between steps: DCP would read freed memory.
            leaf.bring_momentum_back()
        create_state(leaf)
        for group in leaf.param_groups:
            for param in group["params"]:
                state = leaf.state[param]
                groups = _param_process_groups(param)
                # A tensor step (Adam's); SOAP's is a Python int, counted by every rank alike.
                if torch.is_tensor(state.get("step")) and groups:
                    key = tuple(id(g) for g in groups)
                    mesh_groups[key] = groups
                    stepped.setdefault(key, []).append(state["step"])
    # One all_reduce per mesh dim of each distinct mesh, in first-appearance order (the same on
    # every rank of the mesh: Megatron-FSDP gives every rank the same params in the same order).
    for key, steps in stepped.items():
        device = collective_device(mesh_groups[key][0])
        values = torch.stack([s.detach().to(device, torch.float64) for s in steps])
        for process_group in mesh_groups[key]:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=process_group)
        for step, value in zip(steps, values.tolist(), strict=True):
            step.fill_(value)

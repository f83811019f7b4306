"""Optimizer state created without a step is the state the optimizer's own first step creates.

``ensure_optimizer_state`` (used before every checkpoint save and load, and by the factory and the
pretrain entry point's checkpoint guard) creates every param's state now, so that a rank holding
no rows of a param still holds its state. Each optimizer it knows is compared with a copy that
took one real step: the same keys, and each tensor of the same dtype, device and shape (torch's
Adam keeps ``step`` in fp32 when fused, else in fp64 under a fp64 default dtype, on the CPU); the
moments are zeros and the params are untouched (no weight decay applied).
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_muon.checkpointing import ensure_optimizer_state


def _adam(params, **kwargs):
    return torch.optim.Adam(params, lr=0.1, **kwargs)


def _adamw(params, **kwargs):
    return torch.optim.AdamW(params, lr=0.1, weight_decay=0.5, **kwargs)


def _lion(params):
    from emerging_optimizers.scalar_optimizers import Lion

    return Lion(params, lr=0.1, weight_decay=0.5)


def _muon(params):
    from emerging_optimizers.orthogonalized_optimizers import Muon

    return Muon(params, lr=0.1, weight_decay=0.5)


OPTIMIZERS = {
    "adam": _adam,
    "adamw": _adamw,
    "adamw_amsgrad": lambda params: _adamw(params, amsgrad=True),
    "adamw_fused": lambda params: _adamw(params, fused=True),
    "lion": _lion,
    "muon": _muon,
}


@pytest.fixture(params=[torch.float32, torch.float64], ids=["fp32_default", "fp64_default"])
def default_dtype(request):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(request.param)
    yield request.param
    torch.set_default_dtype(previous)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_created_without_a_step_is_the_state_the_first_step_creates(name, default_dtype):
    if name == "muon" and default_dtype == torch.float64:
        pytest.skip("emerging-optimizers' Muon steps fp32 only (its Newton-Schulz refuses fp64)")
    make = OPTIMIZERS[name]
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5, 3))]
    stepped_params = copy.deepcopy(params)
    before = [p.detach().clone() for p in params]

    created = make(params)
    ensure_optimizer_state(created)
    stepped = make(stepped_params)
    for param in stepped_params:
        param.grad = torch.zeros_like(param)
    stepped.step()

    for param, stepped_param, original in zip(params, stepped_params, before, strict=True):
        assert torch.equal(param, original), f"{name}: creating state changed a param"
        mine, theirs = created.state[param], stepped.state[stepped_param]
        assert sorted(mine) == sorted(theirs), name
        for key, value in theirs.items():
            assert torch.is_tensor(mine[key]) == torch.is_tensor(value), (name, key)
            if not torch.is_tensor(value):
                continue
            described = (mine[key].dtype, mine[key].device, mine[key].shape)
            assert described == (value.dtype, value.device, value.shape), (name, key)
            if key != "step":
                assert not mine[key].any(), (name, key)
            else:
                assert mine[key].item() == 0, name

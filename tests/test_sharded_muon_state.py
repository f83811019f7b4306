"""ShardedMuon's optimizer state where torch's optimizer API leaves it missing, and refused params.

TensorParallelMuon creates state lazily, so a param added with ``add_param_group``, or a state dict
saved by a TensorParallelMuon in which one param never had a grad, has no ``momentum_buffer``;
ShardedMuon creates it in ``step()`` (zeros, locally) and then matches TensorParallelMuon stepping
the same params. Complex params and non-matrices are refused by name, with nothing added.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.muon_reference import MUON_KWARGS, TOLERANCE, full_tensor
from tests.row_split_parity import offsets, relative_errors, set_sharded_grad, sharded_param

SHAPES = [(12, 8), (8, 12), (6, 6)]


def _plain_params(seed: int = 0) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(full_tensor(s, seed=seed + i)) for i, s in enumerate(SHAPES)]


def _step_both(optimizer, reference, params, reference_params, step: int) -> None:
    for i, (p, ref) in enumerate(zip(params, reference_params, strict=True)):
        p.grad = full_tensor(p.shape, seed=100 * step + i)
        ref.grad = p.grad.clone()
    optimizer.step()
    reference.step()


def _assert_steps_equal_tensor_parallel_muon(optimizer, reference, params, reference_params):
    """Two more steps of both: params and momentum bitwise equal (one matrix per shape)."""
    for step in (1, 2):
        _step_both(optimizer, reference, params, reference_params, step)
    for p, ref in zip(params, reference_params, strict=True):
        assert torch.equal(p, ref)
        assert torch.equal(
            optimizer.state[p]["momentum_buffer"], reference.state[ref]["momentum_buffer"]
        )


def test_a_param_added_with_add_param_group_gets_state_and_matches_tensor_parallel_muon():
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from megatron_muon import ShardedMuon

    params, reference_params = _plain_params(), _plain_params()
    optimizer = ShardedMuon.from_keywords(params[:2], **MUON_KWARGS)
    reference = TensorParallelMuon(reference_params[:2], **MUON_KWARGS)
    _step_both(optimizer, reference, params[:2], reference_params[:2], step=0)
    optimizer.add_param_group({"params": [params[2]], "lr": 0.01})
    reference.add_param_group({"params": [reference_params[2]], "lr": 0.01})
    assert params[2] not in optimizer.state or not optimizer.state[params[2]]
    _assert_steps_equal_tensor_parallel_muon(optimizer, reference, params, reference_params)


def test_a_tensor_parallel_muon_state_dict_without_a_momentum_loads_and_steps_like_it():
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from megatron_muon import ShardedMuon

    saved_params = _plain_params()
    saving = TensorParallelMuon(saved_params, **MUON_KWARGS)
    saved_params[0].grad = full_tensor(SHAPES[0], seed=7)
    saved_params[2].grad = full_tensor(SHAPES[2], seed=8)  # param 1 never has a grad
    saving.step()
    state_dict = saving.state_dict()
    assert sorted(state_dict["state"]) == [0, 2]

    params = [torch.nn.Parameter(p.detach().clone()) for p in saved_params]
    reference_params = [torch.nn.Parameter(p.detach().clone()) for p in saved_params]
    optimizer = ShardedMuon.from_keywords(params, **MUON_KWARGS)
    reference = TensorParallelMuon(reference_params, **MUON_KWARGS)
    # Copies: load_state_dict keeps the saved tensors themselves, which both would then update.
    optimizer.load_state_dict(copy.deepcopy(state_dict))
    reference.load_state_dict(copy.deepcopy(state_dict))
    assert "momentum_buffer" not in optimizer.state[params[1]]
    _assert_steps_equal_tensor_parallel_muon(optimizer, reference, params, reference_params)


def _add_group_on_ranks(rank: int, world_size: int) -> dict:
    """Rank 1 holds no rows of the added param (grad None there): state must still appear."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_muon import ShardedMuon

    mesh = init_device_mesh("cpu", (world_size,))
    splits = [[5, 7], [4, 4], [6, 0]]
    fulls = [full_tensor(shape, seed=i) for i, shape in enumerate(SHAPES)]
    params = [sharded_param(f, rows, rank, mesh) for f, rows in zip(fulls, splits, strict=True)]
    reference_params = [torch.nn.Parameter(f.clone()) for f in fulls]
    optimizer = ShardedMuon.from_keywords(params[:2], **MUON_KWARGS)
    reference = TensorParallelMuon(reference_params[:2], **MUON_KWARGS)
    for step in range(3):
        if step == 1:
            optimizer.add_param_group({"params": [params[2]]})
            reference.add_param_group({"params": [reference_params[2]]})
        count = 2 if step == 0 else 3
        for i in range(count):
            grad = full_tensor(SHAPES[i], seed=100 * step + i)
            reference_params[i].grad = grad.clone()
            set_sharded_grad(params[i], grad, splits[i], rank, none_if_empty=True)
        optimizer.step()
        reference.step()
    starts = [offsets(rows)[rank] for rows in splits]
    return relative_errors(params, optimizer, reference_params, reference, starts)


@pytest.mark.multirank
def test_an_added_param_with_an_empty_shard_gets_state_on_every_rank_and_matches():
    for errors in run_on_ranks(_add_group_on_ranks, 2, timeout=120):
        assert errors["param"] <= TOLERANCE and errors["momentum"] <= TOLERANCE, errors


@pytest.mark.parametrize(
    ("param", "message"),
    [
        (torch.zeros(4, 4, dtype=torch.complex64), "param 1 has complex dtype torch.complex64"),
        (torch.zeros(4), r"param 1 has shape \(4,\) \(1-D\)"),
    ],
)
def test_complex_and_non_matrix_params_are_refused_by_position(param, message):
    from megatron_muon import ShardedMuon

    with pytest.raises(ValueError, match=message):
        ShardedMuon.from_keywords(
            [torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(param)]
        )


def test_a_refused_param_group_leaves_the_optimizer_unchanged_and_names_the_param():
    from megatron_muon import ShardedMuon

    first = ("linear_fc1.weight", torch.nn.Parameter(torch.zeros(4, 4)))
    optimizer = ShardedMuon.from_keywords([first], **MUON_KWARGS)
    added = [
        ("linear_fc2.weight", torch.nn.Parameter(torch.zeros(3, 3))),
        ("rotary.weight", torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))),
    ]
    with pytest.raises(ValueError, match=r"param 2 \(rotary.weight\) has complex dtype"):
        optimizer.add_param_group({"params": added})
    assert [len(group["params"]) for group in optimizer.param_groups] == [1]

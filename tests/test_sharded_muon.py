"""ShardedMuon equals an unsharded single-process Muon on the full matrices (fp32, highest prec.).

Every test steps a sharded copy and megatron-core's ``TensorParallelMuon`` on the full params side
by side for several steps with fresh random grads, and compares each rank's rows of params and
momentum with the reference's rows: relative error (Frobenius, over the whole matrix) <= 1e-6.
The same Muon in float64 steps beside them: ours is within ``FLOAT64_DISTANCE_FACTOR`` times the
fp32 reference's own distance from it (tests/muon_reference.py), the bound that holds at any size;
``test_one_step_update_...`` applies it to one step's update itself.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.muon_reference import (
    MUON_KWARGS,
    TOLERANCE,
    Float64Muon,
    assert_ranks_within_float64_bound,
    float64_distances,
    float64_params,
    full_tensor,
)
from tests.row_split_parity import (
    relative_errors,
    row_float64_distances,
    run_constructed_splits,
    set_sharded_grad,
    sharded_param,
    splits_for_rows,
)

SHAPES = [(48, 16), (16, 48), (33, 7), (7, 33)]


def _splits_for(world_size: int, kind: str, shapes=SHAPES) -> list[list[int]]:
    def split(rows: int) -> list[int]:
        if kind == "even":
            base = [rows // world_size] * world_size
            base[-1] += rows - sum(base)
            return base
        if kind == "uneven":
            weights = [r + 1 for r in range(world_size)]
            parts = [rows * w // sum(weights) for w in weights]
            parts[-1] += rows - sum(parts)
            return parts
        # "empty": the middle ranks hold nothing, the first and last hold everything
        parts = [0] * world_size
        parts[0] = rows // 3
        parts[-1] = rows - parts[0]
        return parts

    return [split(rows) for rows, _ in shapes]


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("kind", ["even", "uneven", "empty"])
@pytest.mark.parametrize("mode", ["owner", "gather"])
def test_matches_unsharded_muon_on_constructed_row_splits(world_size, kind, mode):
    splits = _splits_for(world_size, kind)
    results = run_on_ranks(run_constructed_splits, world_size, SHAPES, splits, mode, 3)
    for rank, result in enumerate(results):
        assert result["errors"]["param"] <= TOLERANCE, (rank, result["errors"])
        assert result["errors"]["momentum"] <= TOLERANCE, (rank, result["errors"])
    assert_ranks_within_float64_bound(results)


@pytest.mark.multirank
def test_owner_and_gather_modes_give_the_same_params():
    splits = _splits_for(3, "uneven")
    owner = run_on_ranks(run_constructed_splits, 3, SHAPES, splits, "owner", 2)
    gather = run_on_ranks(run_constructed_splits, 3, SHAPES, splits, "gather", 2)
    for o, g in zip(owner, gather, strict=True):
        for a, b in zip(o["locals"], g["locals"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_the_check_would_catch_newton_schulz_on_local_pieces():
    """NS on a rank's rows alone differs from NS on the full matrix far beyond the tolerance, so the
    parity tests above fail for an optimizer that orthogonalizes pieces."""
    from megatron_muon.newton_schulz.methods import NSConfig, scaled_orthogonalize

    torch.set_float32_matmul_precision("highest")
    config = NSConfig()
    full = full_tensor((48, 16), seed=3)
    whole = scaled_orthogonalize(full, config)
    pieces = torch.cat([scaled_orthogonalize(part, config) for part in full.split([20, 28])])
    assert ((pieces - whole).norm() / whole.norm()).item() > 1e3 * TOLERANCE


# One step from zero params: each param is then the step's update itself (-lr * scaled NS), so the
# comparison sees Newton-Schulz's rounding, not a small change to a larger weight that fp32 rounds
# (in the multi-step tests above the weights' own rounding, ~4e-8, dominates). Three same-shape
# matrices are batched into one NS call; the largest NS is the one a split plan shares.
UPDATE_SHAPES = [(256, 64), (64, 256), (96, 96), (64, 32), (64, 32), (64, 32), (33, 7), (7, 33)]


def _run_one_step_update(rank: int, world_size: int, sharded_only: dict) -> dict:
    splits = _splits_for(world_size, "empty", UPDATE_SHAPES)
    return run_constructed_splits(
        rank,
        world_size,
        UPDATE_SHAPES,
        splits,
        "owner",
        1,
        sharded_only=sharded_only,
        zero_start=True,
    )


@pytest.mark.multirank
@pytest.mark.parametrize(
    "sharded_only",
    [{}, {"ns_method": "symmetric"}, {"min_split_flops": 0}],
    ids=["standard", "symmetric", "split_ns"],
)
def test_one_step_update_is_as_close_to_float64_muon_as_the_fp32_reference(sharded_only):
    """The update of one step, per matrix and rank, against Muon in float64: within
    ``FLOAT64_DISTANCE_FACTOR`` times the fp32 reference's own distance (tests/muon_reference.py).

    This is the bound that holds at any size (the fp32 reference is ~5e-7 from float64 on these
    matrices, 5e-6 on a 4096 x 256 one). Gram NS is left out: it rewrites the polynomial
    (R = X X^T), and its bound against float64 is its own (tests/test_newton_schulz.py).
    """
    results = run_on_ranks(_run_one_step_update, 4, sharded_only)
    assert any(result["stats"].bytes_sent for result in results)  # the rows really moved
    assert_ranks_within_float64_bound(results)


def test_the_float64_bound_would_catch_bf16_newton_schulz():
    """NS with bf16 matmuls is ~1e-3 from float64 Muon, far beyond the bound: a lost precision
    (or a lost row block) fails the test above."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    def one_step(optimizer_class, dtype, **overrides):
        param = torch.nn.Parameter(torch.zeros(96, 64, dtype=dtype))
        param.grad = full_tensor((96, 64), seed=5).to(dtype)
        optimizer_class([param], **{**MUON_KWARGS, **overrides}).step()
        return param.detach()

    truth = one_step(Float64Muon, torch.float64)
    reference = one_step(TensorParallelMuon, torch.float32)
    bf16 = one_step(TensorParallelMuon, torch.float32, fp32_matmul_prec="medium")
    distances = float64_distances(bf16, reference, truth)
    assert distances.ours > 100 * distances.bound, distances


def _run_balance(rank: int, world_size: int, shapes: list[tuple[int, int]]) -> dict:
    splits = [splits_for_rows(rows, world_size) for rows, _ in shapes]
    owner = run_constructed_splits(rank, world_size, shapes, splits, "owner", 1)
    gather = run_constructed_splits(rank, world_size, shapes, splits, "gather", 1)
    return {
        "owner": owner["stats"],
        "gather": gather["stats"],
        "errors": owner["errors"],
        "float64": owner["float64"],
    }


def _transformer_shapes(num_layers: int, hidden: int) -> list[tuple[int, int]]:
    per_layer = [(3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden)]
    return per_layer * num_layers


@pytest.mark.multirank
def test_owner_mode_balances_ns_flops_and_moves_about_twice_the_own_shard():
    world_size = 4
    shapes = _transformer_shapes(12, 32)
    results = run_on_ranks(_run_balance, world_size, shapes)
    owner_flops = [r["owner"].ns_flops for r in results]
    gather_flops = [r["gather"].ns_flops for r in results]
    assert max(owner_flops) <= 1.15 * sum(owner_flops) / world_size, owner_flops
    # gather repeats every matrix's NS on every rank
    assert min(gather_flops) == sum(owner_flops), (gather_flops, owner_flops)
    own_shard_bytes = 4 * sum(rows * cols for rows, cols in shapes) / world_size
    for r in results:
        assert r["owner"].bytes_sent <= 2.0 * own_shard_bytes, (
            r["owner"].bytes_sent,
            own_shard_bytes,
        )
        assert r["gather"].bytes_sent >= (world_size - 1) * own_shard_bytes
        assert r["errors"]["param"] <= TOLERANCE
    assert_ranks_within_float64_bound(results)


def _run_real_fsdp_layout(rank: int, world_size: int, strategy: str, mode: str) -> dict:
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    from torch.distributed.tensor import DTensor

    from megatron_muon import ShardedMuon
    from megatron_muon.engine.layout import local_tensor
    from tests.fsdp_models import ToyMLP, fully_shard_toy

    torch.manual_seed(0)
    model = ToyMLP()
    fulls = {n: p.detach().clone() for n, p in model.named_parameters() if p.ndim == 2}
    wrapped = fully_shard_toy(model, world_size, strategy)
    params = [p for n, p in wrapped.named_parameters() if p.ndim == 2]
    names = [n for n, p in wrapped.named_parameters() if p.ndim == 2]
    reference_params = [torch.nn.Parameter(fulls[n.removeprefix("module.")].clone()) for n in names]
    truth_params = float64_params(reference_params)
    optimizer = ShardedMuon.from_keywords(params, mode=mode, **MUON_KWARGS)
    reference = TensorParallelMuon(reference_params, **MUON_KWARGS)
    truth = Float64Muon(truth_params, **MUON_KWARGS)
    rows = {}
    for step in range(3):
        for i, (p, ref) in enumerate(zip(params, reference_params, strict=True)):
            grad = full_tensor(ref.shape, seed=1000 * step + i)
            ref.grad = grad.clone()
            truth_params[i].grad = grad.double()
            local = local_tensor(p)
            start = p.megatron_fsdp_slice.start // ref.shape[1] if local.shape != ref.shape else 0
            rows[names[i]] = (start, local.shape[0])
            p.grad = (
                None
                if local.shape[0] == 0
                else DTensor.from_local(
                    grad[start : start + local.shape[0]].clone(),
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
            )
        optimizer.step()
        reference.step()
        truth.step()
    starts = [rows[n][0] for n in names]
    errors = relative_errors(params, optimizer, reference_params, reference, starts)
    distances = row_float64_distances(params, reference_params, truth_params, starts)
    return {"errors": errors, "float64": distances, "rows": rows}


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_matches_unsharded_muon_on_a_real_megatron_fsdp_layout(world_size, strategy):
    results = run_on_ranks(_run_real_fsdp_layout, world_size, strategy, "owner")
    for result in results:
        assert result["errors"]["param"] <= TOLERANCE, result
        assert result["errors"]["momentum"] <= TOLERANCE, result
    assert_ranks_within_float64_bound(results)
    if world_size == 3 and strategy == "optim":
        # Megatron-FSDP cuts flat buckets between whole rows, so with 3 ranks this layout leaves a
        # rank with zero rows (grad None) of a param.
        assert any(rows == 0 for result in results for _, rows in result["rows"].values()), [
            r["rows"] for r in results
        ]


@pytest.mark.multirank
def test_dp1_needs_no_exchange_and_matches_unsharded_muon():
    [result] = run_on_ranks(run_constructed_splits, 1, SHAPES, [[r] for r, _ in SHAPES], "owner", 3)
    assert result["errors"]["param"] <= TOLERANCE and result["errors"]["momentum"] <= TOLERANCE
    assert_ranks_within_float64_bound([result])
    assert result["stats"].num_collectives == 0
    assert result["stats"].bytes_sent == 0


def _run_ns_method(rank: int, world_size: int, ns_method: str) -> list[torch.Tensor]:
    splits = _splits_for(world_size, "empty") if world_size > 1 else [[r] for r, _ in SHAPES]
    result = run_constructed_splits(
        rank, world_size, SHAPES, splits, "owner", 2, sharded_only={"ns_method": ns_method}
    )
    return result["locals"]


@pytest.mark.multirank
@pytest.mark.parametrize("ns_method", ["gram", "symmetric"])
def test_own_newton_schulz_methods_are_as_exact_under_sharding_as_unsharded(ns_method: str):
    [unsharded] = run_on_ranks(_run_ns_method, 1, ns_method)
    sharded = run_on_ranks(_run_ns_method, 2, ns_method)
    splits = _splits_for(2, "empty")
    for i, full in enumerate(unsharded):
        mine = torch.cat([sharded[r][i] for r in range(2)])
        assert sum(splits[i]) == full.shape[0]
        assert ((mine - full).norm() / full.norm()).item() <= TOLERANCE


def _run_offload(rank: int, world_size: int, offload: bool) -> dict:
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_muon import ShardedMuon
    from megatron_muon.engine.layout import local_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    splits = _splits_for(world_size, "empty")
    fulls = [full_tensor(shape, seed=i) for i, shape in enumerate(SHAPES)]

    def build():
        params = [sharded_param(f, rows, rank, mesh) for f, rows in zip(fulls, splits, strict=True)]
        return params, ShardedMuon.from_keywords(params, offload_momentum=offload, **MUON_KWARGS)

    def train(params, optimizer, steps, first):
        for step in range(first, first + steps):
            for i, (p, rows) in enumerate(zip(params, splits, strict=True)):
                grad = full_tensor(p.shape, seed=1000 * step + i + 100)
                set_sharded_grad(p, grad, rows, rank, none_if_empty=True)
            optimizer.step()

    params, optimizer = build()
    train(params, optimizer, 3, 0)
    released = [
        local_tensor(optimizer.state[p]["momentum_buffer"]).untyped_storage().size() for p in params
    ]
    state = optimizer.state_dict()
    momentum = [
        local_tensor(state["state"][i]["momentum_buffer"]).clone() for i in range(len(params))
    ]
    # resume into fresh params/optimizer and continue
    resumed_params, resumed = build()
    with torch.no_grad():
        for mine, trained in zip(resumed_params, params, strict=True):
            local_tensor(mine).copy_(local_tensor(trained))
    resumed.load_state_dict(copy.deepcopy(state))  # a copy, as a save and a load would give
    train(resumed_params, resumed, 2, 3)
    train(params, optimizer, 2, 3)
    return {
        "released": released,
        "momentum": momentum,
        "params": [local_tensor(p).detach().clone() for p in params],
        "resumed": [local_tensor(p).detach().clone() for p in resumed_params],
    }


@pytest.mark.multirank
def test_momentum_offload_is_bitwise_equal_to_resident_momentum_and_survives_resume():
    resident = run_on_ranks(_run_offload, 2, False)
    offloaded = run_on_ranks(_run_offload, 2, True)
    for r, o in zip(resident, offloaded, strict=True):
        assert all(size == 0 for size in o["released"]), o["released"]  # storage really freed
        assert all(
            size > 0 for size, m in zip(r["released"], r["momentum"], strict=True) if m.numel()
        )
        for a, b in zip(r["momentum"], o["momentum"], strict=True):
            assert torch.equal(a, b)
        for a, b, c in zip(r["params"], o["params"], o["resumed"], strict=True):
            assert torch.equal(a, b)
            assert torch.equal(b, c)


def test_runs_in_a_single_process_without_torch_distributed():
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from megatron_muon import ShardedMuon

    assert not torch.distributed.is_initialized()
    fulls = [full_tensor(shape, seed=i) for i, shape in enumerate(SHAPES)]
    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    reference_params = [torch.nn.Parameter(f.clone()) for f in fulls]
    optimizer = ShardedMuon.from_keywords(params, **MUON_KWARGS)
    reference = TensorParallelMuon(reference_params, **MUON_KWARGS)
    for step in range(2):
        for i, (p, ref) in enumerate(zip(params, reference_params, strict=True)):
            p.grad = full_tensor(p.shape, seed=10 * step + i)
            ref.grad = p.grad.clone()
        optimizer.step()
        reference.step()
    for p, ref in zip(params, reference_params, strict=True):
        assert torch.equal(p, ref)  # one matrix per shape: the same 2-D NS call, bitwise


@pytest.mark.parametrize(
    "override,message",
    [
        ({"lr": -0.01}, "lr must be >= 0, got -0.01"),
        ({"lr": float("nan")}, "lr must be >= 0, got nan"),
        ({"momentum": 1.0}, "momentum must be in [0, 1), got 1.0"),
        ({"momentum": -0.1}, "momentum must be in [0, 1), got -0.1"),
        ({"weight_decay": -0.05}, "weight_decay must be >= 0, got -0.05"),
        ({"scale_mode": "spectrum"}, "scale_mode must be one of"),
        ({"mode": "owners"}, "mode must be one of"),
        ({"min_split_flops": -1}, "min_split_flops must be >= 0, got -1"),
        ({"custom_coefficient_sets": [(3.0, -4.0, 2.0)]}, "custom_coefficient_sets is only used"),
        ({"ns_method": "gram", "gram_restarts": (5,)}, "gram restarts must be increasing"),
    ],
)
def test_bad_hyperparameters_are_refused_at_construction(override, message):
    # A negative lr steps uphill; a bad scale_mode used to fail only inside the first step.
    from megatron_muon import ShardedMuon

    with pytest.raises(ValueError) as error:
        ShardedMuon.from_keywords(
            [torch.nn.Parameter(torch.randn(8, 4))], **{**MUON_KWARGS, **override}
        )
    assert str(error.value).startswith(message), str(error.value)


def test_sharded_muon_takes_its_settings_as_configs_and_names_an_unknown_keyword():
    from megatron_muon import MuonConfig, MuonFsdpConfig, ShardedMuon

    params = [torch.nn.Parameter(torch.randn(8, 4))]
    muon = ShardedMuon(params, muon=MuonConfig(split_qkv=False), fsdp=MuonFsdpConfig(mode="gather"))
    assert (muon.fsdp_config.mode, muon.nesterov, muon.tp_mode) == ("gather", False, "blockwise")
    assert ShardedMuon(params).muon_config == MuonConfig(split_qkv=False)
    # from_keywords: TensorParallelMuon's defaults where a MuonConfig field is not named.
    keyworded = ShardedMuon.from_keywords(params, momentum=0.9, mode="gather")
    assert (keyworded.nesterov, keyworded.tp_mode, keyworded.split_qkv) == (
        True,
        "duplicated",
        False,
    )
    assert keyworded.fsdp_config == MuonFsdpConfig(mode="gather")
    with pytest.raises(TypeError, match="bucket_size"):
        ShardedMuon.from_keywords(params, bucket_size=1)
    with pytest.raises(ValueError, match="split_qkv=True needs is_qkv_fn"):
        ShardedMuon(params, muon=MuonConfig())

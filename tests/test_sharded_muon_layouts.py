"""ShardedMuon on HSDP meshes, with tensor parallelism, on 3-D expert tensors, and in buckets.

Each case compares against megatron-core's unsharded ``TensorParallelMuon`` on the full (TP-full,
DP-full) matrices in one process, fp32 with highest matmul precision: relative error <= 1e-6; and
against the same Muon in float64: within ``FLOAT64_DISTANCE_FACTOR`` times the fp32 reference's
own distance from it (tests/muon_reference.py).
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.muon_reference import (
    MUON_KWARGS,
    TOLERANCE,
    assert_ranks_within_float64_bound,
    float64_distances,
    full_tensor,
)
from tests.row_split_parity import (
    float64_reference,
    position_errors,
    position_float64_distances,
    position_rows,
    relative_error,
    row_shard,
    run_constructed_splits,
    sharded_and_full,
    splits_for_rows,
    step_both,
)

pytestmark = pytest.mark.multirank  # every test here launches ranks


# --------------------------------------------------------------------------------------------------
# HSDP: [Replicate(), Shard(0)] on a 2x2 mesh, rows sharded over the inner dim, dp group = all 4
# --------------------------------------------------------------------------------------------------


def _run_hsdp(rank: int, world_size: int, mode: str) -> dict:
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from megatron_muon import ShardedMuon

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "fsdp"))
    inner = mesh.get_coordinate()[1]
    shapes = [(48, 16), (16, 48), (33, 7)]
    splits = [[20, 28], [16, 0], [3, 30]]
    fulls = [full_tensor(s, seed=i) for i, s in enumerate(shapes)]

    params, reference_params, grad_rows = sharded_and_full(
        fulls, splits, inner, mesh, [Replicate(), Shard(0)]
    )
    optimizer = ShardedMuon.from_keywords(params, mode=mode, **MUON_KWARGS)
    reference = TensorParallelMuon(reference_params, **MUON_KWARGS)
    truth = float64_reference(reference_params, **MUON_KWARGS)
    step_both(params, reference_params, optimizer, reference, grad_rows, 3, truth)
    error = max(position_errors(params, reference_params, splits, inner))
    truth_params = truth.param_groups[0]["params"]
    return {
        "error": error,
        "float64": position_float64_distances(
            params, reference_params, truth_params, splits, inner
        ),
        "locals": [p.to_local().detach().clone() for p in params],
    }


@pytest.mark.parametrize("mode", ["owner", "gather"])
def test_hsdp_replicas_stay_bitwise_equal_and_match_unsharded_muon(mode):
    results = run_on_ranks(_run_hsdp, 4, mode)
    for result in results:
        assert result["error"] <= TOLERANCE
    assert_ranks_within_float64_bound(results)
    # ranks 0 and 2 (and 1 and 3) are replicas: same inner shard coordinate
    for a, b in ((0, 2), (1, 3)):
        for x, y in zip(results[a]["locals"], results[b]["locals"], strict=True):
            assert torch.equal(x, y)


# --------------------------------------------------------------------------------------------------
# TP=2 x DP=2 with tp_mode duplicated / distributed and QKV split
# --------------------------------------------------------------------------------------------------

QKV_SPLIT = [8, 4, 4]  # per query group: 2 query heads x 4, one key head x 4, one value head x 4
NUM_QUERY_GROUPS = 4


def _run_tp_dp(rank: int, world_size: int, tp_mode: str, mode: str) -> dict:
    from megatron.core import parallel_state
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from megatron_muon import ShardedMuon

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        tp_rank, dp_rank = pgc.tp.rank(), pgc.dp_cp.rank()
        mesh = DeviceMesh.from_group(pgc.dp_cp, "cpu")
        hidden = 32
        specs = [  # (full shape, partition_dim, dp row split of the TP-local matrix, is_qkv)
            ((NUM_QUERY_GROUPS * sum(QKV_SPLIT), hidden), 0, [12, 20], True),
            ((hidden, 2 * hidden), 1, [32, 0], False),
            ((48, hidden), 0, [10, 14], False),
        ]
        fulls = [full_tensor(shape, seed=i) for i, (shape, *_rest) in enumerate(specs)]

        def tp_local(i: int, full: torch.Tensor) -> torch.Tensor:
            return full.chunk(2, dim=specs[i][1])[tp_rank]

        def dp_rows(i: int) -> slice:
            return position_rows(specs[i][2], dp_rank)

        def dtensor(i: int, full: torch.Tensor) -> DTensor:
            return row_shard(tp_local(i, full), dp_rows(i), mesh, [Shard(0)])

        params = []
        for i, full in enumerate(fulls):
            p = torch.nn.Parameter(dtensor(i, full))
            p.partition_dim = specs[i][1]
            p.tensor_model_parallel = True
            p.is_qkv = specs[i][3]
            params.append(p)
        reference_params = [torch.nn.Parameter(f.clone()) for f in fulls]
        reference_params[0].is_qkv = True
        qkv_kwargs = dict(
            split_qkv=True,
            is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
            qkv_split_shapes=QKV_SPLIT,
        )
        kwargs = {**MUON_KWARGS, **qkv_kwargs}
        optimizer = ShardedMuon.from_keywords(
            params,
            dp_group=pgc.dp_cp,
            mode=mode,
            pg_collection=pgc,
            **{**kwargs, "tp_mode": tp_mode},
        )
        reference = TensorParallelMuon(reference_params, **kwargs)
        truth = float64_reference(reference_params, **kwargs)
        step_both(
            params,
            reference_params,
            optimizer,
            reference,
            lambda i, g: None if specs[i][2][dp_rank] == 0 else dtensor(i, g),
            2,
            truth,
        )
        errors, distances = [], {}
        truth_params = truth.param_groups[0]["params"]
        for i, (p, ref, full64) in enumerate(
            zip(params, reference_params, truth_params, strict=True)
        ):
            expected = tp_local(i, ref.detach())[dp_rows(i)]
            errors.append(relative_error(p.to_local(), expected, ref.detach()))
            distances[f"param {i}"] = float64_distances(
                p.to_local(),
                expected,
                tp_local(i, full64.detach())[dp_rows(i)],
                norm=full64.detach().norm(),
            )
        return {"errors": errors, "float64": distances}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp_mode", ["duplicated", "distributed"])
@pytest.mark.parametrize("mode", ["owner", "gather"])
def test_tp2_dp2_with_qkv_split_matches_unsharded_muon(tp_mode, mode):
    results = run_on_ranks(_run_tp_dp, 4, tp_mode, mode)
    for result in results:
        assert max(result["errors"]) <= TOLERANCE, result
    assert_ranks_within_float64_bound(results)


# --------------------------------------------------------------------------------------------------
# 3-D expert tensors (E, out, in) sharded by whole experts over an expert-DP group
# --------------------------------------------------------------------------------------------------


def _run_experts(rank: int, world_size: int, mode: str) -> dict:
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from megatron_muon import ShardedMuon

    expt_dp = torch.distributed.new_group(list(range(world_size)))
    mesh = init_device_mesh("cpu", (world_size,))
    shapes = [(5, 12, 8), (4, 8, 12), (24, 8)]  # two grouped expert tensors and a 2-D expert weight
    splits = [[2, 0, 3], [1, 3, 0], [9, 9, 6]]
    fulls = [full_tensor(s, seed=i) for i, s in enumerate(shapes)]

    params, reference_params, grad_rows = sharded_and_full(fulls, splits, rank, mesh, [Shard(0)])
    optimizer = ShardedMuon.from_keywords(params, dp_group=expt_dp, mode=mode, **MUON_KWARGS)
    reference = TensorParallelMuon(reference_params, **MUON_KWARGS)
    truth = float64_reference(reference_params, **MUON_KWARGS)
    step_both(params, reference_params, optimizer, reference, grad_rows, 3, truth)
    truth_params = truth.param_groups[0]["params"]
    return {
        "errors": position_errors(params, reference_params, splits, rank),
        "float64": position_float64_distances(params, reference_params, truth_params, splits, rank),
    }


@pytest.mark.parametrize("mode", ["owner", "gather"])
def test_3d_expert_tensors_are_orthogonalized_per_expert_over_the_expert_dp_group(mode):
    results = run_on_ranks(_run_experts, 3, mode)
    for result in results:
        assert max(result["errors"]) <= TOLERANCE, result
    assert_ranks_within_float64_bound(results)


# --------------------------------------------------------------------------------------------------
# buckets bound the full matrices held at once, without changing the result
# --------------------------------------------------------------------------------------------------


def _run_buckets(rank: int, world_size: int, bucket_size_bytes: int | None) -> dict:
    shapes = [(64, 32)] * 6 + [(32, 96)] * 3
    splits = [splits_for_rows(r, world_size) for r, _ in shapes]
    return run_constructed_splits(
        rank,
        world_size,
        shapes,
        splits,
        "owner",
        2,
        sharded_only={"bucket_size_bytes": bucket_size_bytes},
    )


def test_bucketed_exchange_bounds_peak_full_matrix_memory_and_keeps_the_result():
    bucket = 3 * 64 * 32 * 4  # three 64x32 fp32 matrices
    one_bucket = run_on_ranks(_run_buckets, 2, None)
    bucketed = run_on_ranks(_run_buckets, 2, bucket)
    assert_ranks_within_float64_bound(bucketed)
    for whole, parts in zip(one_bucket, bucketed, strict=True):
        assert parts["errors"]["param"] <= TOLERANCE
        assert parts["stats"].peak_full_matrix_bytes <= bucket
        assert parts["stats"].peak_full_matrix_bytes < whole["stats"].peak_full_matrix_bytes
        for a, b in zip(whole["locals"], parts["locals"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _run_overlap(rank: int, world_size: int, overlap: bool) -> dict:
    shapes = [(64, 32)] * 6 + [(32, 96)] * 3
    splits = [splits_for_rows(r, world_size) for r, _ in shapes]
    bucket = 3 * 64 * 32 * 4  # three 64x32 fp32 matrices: three buckets or more
    kwargs = {"bucket_size_bytes": bucket, "overlap_buckets": overlap}
    return run_constructed_splits(
        rank, world_size, shapes, splits, "owner", 2, sharded_only=kwargs
    ) | {"bucket": bucket}


def test_overlapped_buckets_give_bitwise_the_sequential_update_holding_at_most_two_buckets():
    sequential = run_on_ranks(_run_overlap, 2, False)
    overlapped = run_on_ranks(_run_overlap, 2, True)
    assert_ranks_within_float64_bound(overlapped)
    for seq, over in zip(sequential, overlapped, strict=True):
        assert over["errors"]["param"] <= TOLERANCE
        # Same arithmetic in the same order, only the messages' timing differs: bitwise equal.
        for a, b in zip(seq["locals"], over["locals"], strict=True):
            assert torch.equal(a, b)
        assert seq["stats"].peak_full_matrix_bytes <= over["bucket"]
        # More than one bucket was held at once (the overlapped pipeline ran), never more than two.
        assert seq["stats"].peak_full_matrix_bytes < over["stats"].peak_full_matrix_bytes
        assert over["stats"].peak_full_matrix_bytes <= 2 * over["bucket"]


# --------------------------------------------------------------------------------------------------
# HSDP layouts made by megatron_fsdp itself (outer no_shard and outer optim, 2 x 2 ranks)
# --------------------------------------------------------------------------------------------------


def _run_real_hsdp(rank: int, world_size: int, outer: str) -> dict:
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata
    from torch.distributed.tensor import DTensor

    from megatron_muon import ShardedMuon
    from tests.fsdp_models import ToyMLP, hsdp_shard_toy

    torch.manual_seed(0)
    model = ToyMLP(dim=24, hidden=40)
    fulls = {n: p.detach().clone() for n, p in model.named_parameters() if p.ndim == 2}
    wrapped, hsdp_group = hsdp_shard_toy(model, outer)
    named = [(n, p) for n, p in wrapped.named_parameters() if p.ndim == 2]
    params = [p for _, p in named]
    # Row offsets from megatron_fsdp's own chunk metadata: independent of
    # megatron_muon.engine.layout.
    starts = [gather_and_compute_chunk_metadata(p).offsets[0] for p in params]
    reference_params = [
        torch.nn.Parameter(fulls[n.removeprefix("module.")].clone()) for n, _ in named
    ]
    optimizer = ShardedMuon.from_keywords(params, dp_group=hsdp_group, **MUON_KWARGS)
    reference = TensorParallelMuon(reference_params, **MUON_KWARGS)
    truth = float64_reference(reference_params, **MUON_KWARGS)

    def grad_rows(i: int, grad: torch.Tensor):
        local = params[i].to_local()
        if local.shape[0] == 0:
            return None
        return DTensor.from_local(
            grad[starts[i] : starts[i] + local.shape[0]].clone(),
            params[i].device_mesh,
            params[i].placements,
            run_check=False,
            shape=params[i].shape,
            stride=params[i].stride(),
        )

    step_both(params, reference_params, optimizer, reference, grad_rows, 2, truth)
    errors, layout, distances = [], [], {}
    truth_params = truth.param_groups[0]["params"]
    for i, (p, ref, full64, start) in enumerate(
        zip(params, reference_params, truth_params, starts, strict=True)
    ):
        local = p.to_local()
        rows = slice(start, start + local.shape[0])
        layout.append((start, local.shape[0], str(p.placements)))
        errors.append(relative_error(local, ref.detach()[rows], ref.detach()))
        distances[f"param {i}"] = float64_distances(
            local, ref.detach()[rows], full64.detach()[rows], norm=full64.detach().norm()
        )
    return {"errors": errors, "float64": distances, "layout": layout}


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_matches_unsharded_muon_on_megatron_fsdp_hsdp_layouts(outer):
    results = run_on_ranks(_run_real_hsdp, 4, outer)
    for result in results:
        assert max(result["errors"]) <= TOLERANCE, result
    assert_ranks_within_float64_bound(results)


# --------------------------------------------------------------------------------------------------
# split-matrix NS: a plan that shares one matrix's NS over a block of ranks is executed exactly
# --------------------------------------------------------------------------------------------------

SPLIT_CASES = {
    # one wide matrix dominates: split by columns over 4 ranks; a tall one split by rows
    "wide_and_tall": ([(64, 256), (256, 48), (8, 8)], None),
    # a QKV param (pieces wide) split by columns over 2 ranks, a tall matrix over the other 2
    "qkv_by_columns": ([(2 * 32, 96), (128, 32), (16, 16)], [16, 8, 8]),
}


def _run_split_plan(rank: int, world_size: int, case: str, mode: str) -> dict:
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from megatron_muon import ShardedMuon

    shapes, qkv_split = SPLIT_CASES[case]
    mesh = init_device_mesh("cpu", (world_size,))
    splits = [[r // 2, 0, r - r // 2 - r // 4, r // 4] for r, _ in shapes]  # uneven, one empty
    fulls = [full_tensor(s, seed=i) for i, s in enumerate(shapes)]

    params, reference_params, grad_rows = sharded_and_full(fulls, splits, rank, mesh, [Shard(0)])
    kwargs = dict(MUON_KWARGS)
    if qkv_split is not None:
        params[0].is_qkv = reference_params[0].is_qkv = True
        kwargs.update(
            split_qkv=True,
            is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
            qkv_split_shapes=qkv_split,
        )
    optimizer = ShardedMuon.from_keywords(params, mode=mode, min_split_flops=0, **kwargs)
    reference = TensorParallelMuon(reference_params, **kwargs)
    truth = float64_reference(reference_params, **kwargs)
    step_both(params, reference_params, optimizer, reference, grad_rows, 2, truth)
    plan = optimizer.owner_plan()
    truth_params = truth.param_groups[0]["params"]
    return {
        "split_sizes": plan.split_sizes,
        "errors": position_errors(params, reference_params, splits, rank),
        "float64": position_float64_distances(params, reference_params, truth_params, splits, rank),
        "flops": optimizer.step_stats.ns_flops,
    }


@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
def test_split_matrix_ns_plans_are_executed_exactly(case):
    results = run_on_ranks(_run_split_plan, 4, case, "owner")
    assert any(size > 1 for size in results[0]["split_sizes"]), results[0]["split_sizes"]
    for result in results:
        assert max(result["errors"]) <= TOLERANCE, result
    assert_ranks_within_float64_bound(results)
    flops = [r["flops"] for r in results]
    assert max(flops) <= 1.15 * sum(flops) / len(flops), flops

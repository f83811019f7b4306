"""ShardedAdaptiveMuon equals emerging-optimizers' ``AdaptiveMuon`` on the full matrices.

Each rank steps a row-sharded copy (uneven and empty shards; a rank with no rows has ``grad is
None``) and ``AdaptiveMuon`` on the full params side by side, two steps with fresh grads, for every
second-moment method and both NS placements (owner, gather), fp32 with highest matmul precision.
Params, momentum and second moment: relative error (Frobenius, per matrix) <= ``TOLERANCE``
(1e-6), the fp32 reduction-order floor of docs/exactness.md (norms summed over shards round
differently from a sum in one process). Replicated second moments (normuon, namo) are bitwise the
same on every rank. The one-rank case runs in this process, without torch.distributed.
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.muon_reference import MUON_KWARGS, TOLERANCE, full_tensor
from tests.row_split_parity import offsets, set_sharded_grad, sharded_param

METHODS = ("adamuon", "normuon", "namo")
# Tall (normuon per row), wide (per column), odd sizes.
SHAPES = [(48, 16), (16, 48), (33, 7)]
# The Muon settings of tests.muon_reference, with a scale factor that is not 1 (AdaptiveMuon applies
# Muon's scale once, after the second moment); tp_mode is set per test.
KWARGS = {
    **{k: v for k, v in MUON_KWARGS.items() if k != "tp_mode"},
    "extra_scale_factor": 1.5,
}
BETA2, EPS = 0.9, 1e-8
STEPS = 2


def _splits(world_size: int) -> list[list[int]]:
    """Uneven row splits; with 3+ ranks the middle ranks hold nothing of the first matrix."""
    splits = []
    for index, (rows, _) in enumerate(SHAPES):
        if index == 0 and world_size > 2:
            parts = [0] * world_size
            parts[0], parts[-1] = rows // 3, rows - rows // 3
        else:
            weights = [r + 1 for r in range(world_size)]
            parts = [rows * w // sum(weights) for w in weights]
            parts[-1] += rows - sum(parts)
        splits.append(parts)
    return splits


def _reference(method: str, fulls: list[torch.Tensor]):
    from emerging_optimizers.orthogonalized_optimizers import AdaptiveMuon

    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    optimizer = AdaptiveMuon(
        params,
        moment2_method=method,
        beta2=BETA2,
        eps=EPS,
        weight_decay_method="decoupled",
        **{k: v for k, v in KWARGS.items() if k != "extra_scale_factor"},
        extra_scale_factor=KWARGS["extra_scale_factor"],
    )
    return params, optimizer


def _sharded(params, method: str, mode: str, **extra):
    from megatron_muon.optimizers.adaptive_muon import ShardedAdaptiveMuon
    from megatron_muon.optimizers.adaptive_muon_config import AdaptiveMuonConfig

    config = AdaptiveMuonConfig(moment2_method=method, beta2=BETA2, eps=EPS)
    kwargs = {"tp_mode": "blockwise", **KWARGS, **extra}
    return ShardedAdaptiveMuon.from_keywords(params, adaptive=config, mode=mode, **kwargs)


def _errors(params, optimizer, reference_params, reference, starts) -> dict[str, float]:
    """Worst relative error of this rank's rows (params, momentum, adamuon's moment2) and of the
    whole replicated moment2 (normuon, namo)."""
    from torch.distributed.tensor import DTensor

    from megatron_muon.engine.layout import local_tensor

    worst: dict[str, float] = {}
    for p, ref, start in zip(params, reference_params, starts, strict=True):
        rows = slice(start, start + local_tensor(p).shape[0])
        for key, mine, full in (
            ("param", p.detach(), ref.detach()),
            (
                "momentum",
                optimizer.state[p]["momentum_buffer"],
                reference.state[ref]["momentum_buffer"],
            ),
            (
                "moment2",
                optimizer.state[p]["moment2_buffer"],
                reference.state[ref]["moment2_buffer"],
            ),
        ):
            if isinstance(mine, DTensor) or key != "moment2":
                mine, full_rows = local_tensor(mine), full[rows]
            else:
                full_rows = full
            error = ((mine - full_rows).norm() / full.norm()).item()
            worst[key] = max(worst.get(key, 0.0), error)
    return worst


def _run(rank: int, world_size: int) -> dict:
    """Every method and mode on this rank's rows of ``_splits(world_size)``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    splits = _splits(world_size)
    starts = [offsets(rows)[rank] for rows in splits]
    fulls = [full_tensor(shape, seed=i) for i, shape in enumerate(SHAPES)]
    results = {}
    for method in METHODS:
        for mode in ("owner", "gather"):
            params = [
                sharded_param(f, rows, rank, mesh) for f, rows in zip(fulls, splits, strict=True)
            ]
            reference_params, reference = _reference(method, fulls)
            optimizer = _sharded(params, method, mode)
            for step in range(STEPS):
                for i, (p, ref, rows) in enumerate(
                    zip(params, reference_params, splits, strict=True)
                ):
                    grad = full_tensor(ref.shape, seed=1000 * step + i + 100)
                    ref.grad = grad.clone()
                    set_sharded_grad(p, grad, rows, rank, none_if_empty=True)
                optimizer.step()
                reference.step()
            replicated = [
                optimizer.state[p]["moment2_buffer"].clone() for p in params if method != "adamuon"
            ]
            results[(method, mode)] = {
                "errors": _errors(params, optimizer, reference_params, reference, starts),
                "replicated": replicated,
            }
    return results


@pytest.mark.parametrize("method", METHODS)
def test_one_rank_without_torch_distributed_equals_adaptive_muon(method: str) -> None:
    fulls = [full_tensor(shape, seed=i) for i, shape in enumerate(SHAPES)]
    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    reference_params, reference = _reference(method, fulls)
    optimizer = _sharded(params, method, "owner")
    for step in range(STEPS):
        for i, (p, ref) in enumerate(zip(params, reference_params, strict=True)):
            ref.grad = full_tensor(ref.shape, seed=1000 * step + i + 100)
            p.grad = ref.grad.clone()
        optimizer.step()
        reference.step()
    errors = _errors(params, optimizer, reference_params, reference, [0] * len(params))
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_row_shards_equal_adaptive_muon_on_full_matrices(world_size: int) -> None:
    results = run_on_ranks(_run, world_size)
    for rank, by_case in enumerate(results):
        for case, result in by_case.items():
            assert max(result["errors"].values()) <= TOLERANCE, (rank, case, result["errors"])
    for case in results[0]:
        mine = results[0][case]["replicated"]
        for rank in range(1, world_size):
            for a, b in zip(mine, results[rank][case]["replicated"], strict=True):
                assert torch.equal(a, b), (case, rank)


def test_settings_that_cannot_run_exactly_are_refused_naming_them() -> None:
    from megatron_muon.engine.config import MuonFsdpConfig
    from megatron_muon.optimizers.adaptive_muon import ShardedAdaptiveMuon
    from megatron_muon.optimizers.adaptive_muon_config import AdaptiveMuonConfig

    matrix = [torch.nn.Parameter(torch.zeros(4, 4))]
    with pytest.raises(ValueError, match="min_split_flops=0 does not apply"):
        ShardedAdaptiveMuon(matrix, fsdp=MuonFsdpConfig(min_split_flops=0))
    with pytest.raises(ValueError, match="namo.*decoupled"):
        ShardedAdaptiveMuon(
            matrix,
            adaptive=AdaptiveMuonConfig(moment2_method="namo"),
            use_decoupled_weight_decay=False,
        )
    with pytest.raises(ValueError, match="not a matrix"):
        ShardedAdaptiveMuon([torch.nn.Parameter(torch.zeros(2, 4, 4))])
    with pytest.raises(ValueError, match="moment2_method must be one of"):
        AdaptiveMuonConfig(moment2_method="adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="adaptive_muon_beta2 must be in"):
        from megatron.core.optimizer import OptimizerConfig

        AdaptiveMuonConfig.from_optimizer_config(OptimizerConfig(adaptive_muon_beta2=1.0))

"""ShardedMuon on constructed row splits of full matrices, stepped beside the reference.

``sharded_param`` makes rank ``rank``'s rows of a full matrix into a row-sharded (``Shard(0)``,
uneven) DTensor; ``run_constructed_splits`` (a ``run_on_ranks`` rank body) steps ShardedMuon on
such params and ``TensorParallelMuon`` on the full matrices side by side and returns the relative
errors of this rank's rows (``relative_errors``), the step statistics and the local params.
"""

from __future__ import annotations

import torch

from tests.muon_reference import MUON_KWARGS, full_tensor


def offsets(rows: list[int]) -> list[int]:
    return [sum(rows[:r]) for r in range(len(rows))]


def sharded_param(full: torch.Tensor, rows: list[int], rank: int, mesh) -> torch.nn.Parameter:
    from torch.distributed.tensor import DTensor, Shard

    start = offsets(rows)[rank]
    local = full[start : start + rows[rank]].clone()
    return torch.nn.Parameter(
        DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
    )


def set_sharded_grad(
    param, full_grad: torch.Tensor, rows: list[int], rank: int, none_if_empty: bool
):
    from torch.distributed.tensor import DTensor

    start = offsets(rows)[rank]
    if rows[rank] == 0 and none_if_empty:
        param.grad = None
        return
    local = full_grad[start : start + rows[rank]].clone()
    param.grad = DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def relative_errors(params, optimizer, reference_params, reference, row_starts) -> dict:
    """Max over params of ||mine - reference rows|| / ||reference full||, params and momentum."""
    from megatron_muon.sharded.layout import local_tensor

    worst = {"param": 0.0, "momentum": 0.0}
    for p, ref, start in zip(params, reference_params, row_starts, strict=True):
        local = local_tensor(p.detach())
        rows = slice(start, start + local.shape[0])
        momentum = local_tensor(optimizer.state[p]["momentum_buffer"])
        ref_momentum = reference.state[ref]["momentum_buffer"]
        for key, mine, full in (
            ("param", local, ref.detach()),
            ("momentum", momentum, ref_momentum),
        ):
            error = ((mine - full[rows]).norm() / full.norm()).item()
            worst[key] = max(worst[key], error)
    return worst


def run_constructed_splits(
    rank: int,
    world_size: int,
    shapes: list[tuple[int, int]],
    splits: list[list[int]],
    mode: str,
    steps: int,
    extra: dict | None = None,
    sharded_only: dict | None = None,
) -> dict:
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_muon import ShardedMuon

    mesh = init_device_mesh("cpu", (world_size,))
    extra = extra or {}
    fulls = [full_tensor(shape, seed=i) for i, shape in enumerate(shapes)]
    params = [sharded_param(f, rows, rank, mesh) for f, rows in zip(fulls, splits, strict=True)]
    reference_params = [torch.nn.Parameter(f.clone()) for f in fulls]
    optimizer = ShardedMuon(params, mode=mode, **MUON_KWARGS, **extra, **(sharded_only or {}))
    reference = TensorParallelMuon(reference_params, **MUON_KWARGS, **extra)
    for step in range(steps):
        for i, (p, ref, rows) in enumerate(zip(params, reference_params, splits, strict=True)):
            grad = full_tensor(ref.shape, seed=1000 * step + i + 100)
            ref.grad = grad.clone()
            set_sharded_grad(p, grad, rows, rank, none_if_empty=True)
        optimizer.step()
        reference.step()
    errors = relative_errors(
        params, optimizer, reference_params, reference, [offsets(r)[rank] for r in splits]
    )
    locals_ = [p.to_local().detach().clone() for p in params]
    return {"errors": errors, "stats": optimizer.step_stats, "locals": locals_}


def splits_for_rows(rows: int, world_size: int) -> list[int]:
    base = [rows // world_size] * world_size
    base[-1] += rows - sum(base)
    return base

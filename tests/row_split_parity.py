"""ShardedMuon on constructed row splits of full matrices, stepped beside the reference.

``sharded_param`` makes rank ``rank``'s rows of a full matrix into a row-sharded (``Shard(0)``,
uneven) DTensor; ``run_constructed_splits`` (a ``run_on_ranks`` rank body) steps ShardedMuon on
such params, ``TensorParallelMuon`` on the full matrices and the same Muon in float64 side by side
and returns the relative errors of this rank's rows against the fp32 reference
(``relative_errors``), their distances from float64 (``row_float64_distances``), the step
statistics and the local params.

For layouts built elsewhere (HSDP meshes, TP x DP, experts): ``sharded_and_full`` makes the params
of a shard position (``position_rows``), ``step_both`` steps ours, the reference and the float64
run on the same grads, and ``position_errors`` / ``position_float64_distances`` compare the rows.
"""

from __future__ import annotations

import torch

from tests.muon_reference import (
    MUON_KWARGS,
    Float64Distances,
    Float64Muon,
    float64_distances,
    float64_params,
    full_tensor,
)


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
    from megatron_muon.engine.layout import local_tensor

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


def row_float64_distances(
    params, reference_params, float64_params, row_starts
) -> dict[str, Float64Distances]:
    """Per param: this rank's rows of ours and of the fp32 reference, from the same rows of the
    float64 run, relative to the whole float64 matrix."""
    from megatron_muon.engine.layout import local_tensor

    distances = {}
    for i, (p, ref, truth, start) in enumerate(
        zip(params, reference_params, float64_params, row_starts, strict=True)
    ):
        local = local_tensor(p.detach())
        rows = slice(start, start + local.shape[0])
        full = truth.detach()
        distances[f"param {i}"] = float64_distances(
            local, ref.detach()[rows], full[rows], norm=full.norm()
        )
    return distances


def run_constructed_splits(
    rank: int,
    world_size: int,
    shapes: list[tuple[int, int]],
    splits: list[list[int]],
    mode: str,
    steps: int,
    extra: dict | None = None,
    sharded_only: dict | None = None,
    zero_start: bool = False,
) -> dict:
    """``zero_start``: every param starts at zero, so after one step it is the step's update
    itself (``-lr * scaled NS``), not a small change to a larger weight that fp32 rounds."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_muon import ShardedMuon

    mesh = init_device_mesh("cpu", (world_size,))
    extra = extra or {}
    fulls = [
        torch.zeros(shape) if zero_start else full_tensor(shape, seed=i)
        for i, shape in enumerate(shapes)
    ]
    params = [sharded_param(f, rows, rank, mesh) for f, rows in zip(fulls, splits, strict=True)]
    reference_params = [torch.nn.Parameter(f.clone()) for f in fulls]
    truth_params = float64_params(fulls)
    optimizer = ShardedMuon.from_keywords(
        params, mode=mode, **MUON_KWARGS, **extra, **(sharded_only or {})
    )
    reference = TensorParallelMuon(reference_params, **MUON_KWARGS, **extra)
    truth = Float64Muon(truth_params, **MUON_KWARGS, **extra)
    for step in range(steps):
        for i, (p, ref, rows) in enumerate(zip(params, reference_params, splits, strict=True)):
            grad = full_tensor(ref.shape, seed=1000 * step + i + 100)
            ref.grad = grad.clone()
            truth_params[i].grad = grad.double()
            set_sharded_grad(p, grad, rows, rank, none_if_empty=True)
        optimizer.step()
        reference.step()
        truth.step()
    starts = [offsets(r)[rank] for r in splits]
    errors = relative_errors(params, optimizer, reference_params, reference, starts)
    locals_ = [p.to_local().detach().clone() for p in params]
    return {
        "errors": errors,
        "float64": row_float64_distances(params, reference_params, truth_params, starts),
        "stats": optimizer.step_stats,
        "locals": locals_,
    }


def splits_for_rows(rows: int, world_size: int) -> list[int]:
    base = [rows // world_size] * world_size
    base[-1] += rows - sum(base)
    return base


def relative_error(mine: torch.Tensor, full_rows: torch.Tensor, full: torch.Tensor) -> float:
    return ((mine - full_rows).norm() / full.norm()).item()


def position_rows(split: list[int], position: int) -> slice:
    """The rows a shard position holds when rows are split ``split`` (in position order)."""
    start = sum(split[:position])
    return slice(start, start + split[position])


def row_shard(full: torch.Tensor, rows: slice, mesh, placements):
    """``full``'s rows ``rows`` as this rank's local part of an uneven row-sharded DTensor."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        full[rows].clone(),
        mesh,
        placements,
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )


def sharded_and_full(fulls, splits, position: int, mesh, placements):
    """Param i as this rank's rows ``position_rows(splits[i], position)`` of a row-sharded
    DTensor, the full-tensor reference params, and ``grad_rows`` for ``step_both`` (None where no
    rows)."""

    def dtensor(i: int, full: torch.Tensor):
        return row_shard(full, position_rows(splits[i], position), mesh, placements)

    params = [torch.nn.Parameter(dtensor(i, f)) for i, f in enumerate(fulls)]
    reference_params = [torch.nn.Parameter(f.clone()) for f in fulls]

    def grad_rows(i: int, grad: torch.Tensor):
        return None if splits[i][position] == 0 else dtensor(i, grad)

    return params, reference_params, grad_rows


def position_errors(params, reference_params, splits, position: int) -> list[float]:
    """Each param's local rows against the same rows of its reference, relative to the full norm."""
    return [
        relative_error(p.to_local(), ref.detach()[position_rows(splits[i], position)], ref.detach())
        for i, (p, ref) in enumerate(zip(params, reference_params, strict=True))
    ]


def position_float64_distances(
    params, reference_params, truth_params, splits, position: int
) -> dict:
    """Each param's local rows and its fp32 reference's, from the float64 run's same rows."""
    return {
        f"param {i}": float64_distances(
            p.to_local(), ref.detach()[rows], truth.detach()[rows], norm=truth.detach().norm()
        )
        for i, (p, ref, truth) in enumerate(
            zip(params, reference_params, truth_params, strict=True)
        )
        for rows in [position_rows(splits[i], position)]
    }


def float64_reference(reference_params, **kwargs) -> Float64Muon:
    """Muon in float64 on copies of the full reference params (``step_both`` steps it too)."""
    return Float64Muon(float64_params(reference_params), **kwargs)


def step_both(
    params, reference_params, optimizer, reference, grad_rows, steps: int, truth: Float64Muon
) -> None:
    """``grad_rows(i, full_grad)`` returns this rank's grad for param i (or None); ``truth``, the
    float64 run, steps on the same full grads."""
    truth_params = truth.param_groups[0]["params"]
    for step in range(steps):
        for i, ref in enumerate(reference_params):
            grad = full_tensor(ref.shape, seed=1000 * step + i + 7)
            ref.grad = grad.clone()
            truth_params[i].grad = grad.double()
            params[i].grad = grad_rows(i, grad)
        optimizer.step()
        reference.step()
        truth.step()

"""One adapter per orthogonalized optimizer of emerging-optimizers (``ShardedOrthogonalized``).

Each adapter names its class (``name``: the registry name) and how the class's weight-update hooks
meet Megatron-FSDP's row shards (``orthogonalized`` explains the three ways). Four are declarations
only; MuonHyperball and SinkhornMuon also restate what needs the whole weight, with sums over
``dp_group``:

- ``ShardedMuonHyperball``: the radius ``R`` (``hyperball_radius``, or the weight's norm after
  weight decay), the update scaled to ``R`` on its owner (``R / ||update||``, the update whole
  there), the updated weight scaled back to ``R`` (``R / ||weight||``) on every rank's rows:
  MuonHyperball's hook formulas, each norm ``clamp_min(hyperball_eps)`` as there, with the
  weights' norms from ``_whole_norms``; its constructor's zero-norm check and rescale likewise.
- ``ShardedSinkhornMuon``: SinkhornMuon's constructor check of the params (non-negative, row and
  column sums within ``doubly_stochastic_tolerance`` of the mapping's targets), each row's sum on
  its rank, column sums and the minimum reduced over ``dp_group``; its step is Spel's way.

``SHARDED_ORTHOGONALIZED`` maps each ``common.options.OrthogonalizedOptimizerT`` name to its
adapter.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, get_args

import torch
import torch.distributed as dist

from megatron_muon.common.options import OrthogonalizedOptimizerT
from megatron_muon.engine.layout import local_tensor
from megatron_muon.engine.optimizer_plan import OptimizerPlan
from megatron_muon.optimizers.orthogonalized import ShardedOrthogonalized, counts_rows

__all__ = [
    "SHARDED_ORTHOGONALIZED",
    "ShardedMOP",
    "ShardedMuonHyperball",
    "ShardedPolarGrad",
    "ShardedScion",
    "ShardedSinkhornMuon",
    "ShardedSpel",
]

_POST_HOOK = frozenset({"post_weight_update_fn_inplace"})


class ShardedPolarGrad(ShardedOrthogonalized):
    """PolarGrad (NS scaled by the nuclear norm, on the owner): no weight-update hooks."""

    name = "polargrad"


class ShardedScion(ShardedOrthogonalized):
    """Scion: no weight-update hooks."""

    name = "scion"


class ShardedMOP(ShardedOrthogonalized):
    """MOP (the polar factor by SVD, on the owner): no weight-update hooks."""

    name = "mop"


class ShardedSpel(ShardedOrthogonalized):
    """Spel: its post hook (NS of the updated weight) on the owner's full weight."""

    name = "spel"
    handled_hooks = _POST_HOOK
    post_update_on_owner = True


class ShardedMuonHyperball(ShardedOrthogonalized):
    """MuonHyperball: its hooks with whole-weight norms (module docstring).

    Construction is collective over ``dp_group``.

    Raises:
        ValueError: as ``ShardedOrthogonalized``; a param whose whole weight has norm 0 (as
            MuonHyperball).
    """

    name = "muon_hyperball"
    handled_hooks = frozenset({"pre_weight_update_fn_inplace", "post_weight_update_fn_inplace"})

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self._radius: dict[int, float] = {}
        plan = self._step_plan()
        indices = list(range(len(plan.params)))
        radius, eps = self.reference.hyperball_radius, self.reference.hyperball_eps
        for i, norm in zip(indices, self._whole_norms(plan, indices), strict=True):
            if norm.item() == 0:
                raise ValueError(
                    f"{self.label}: param {i} of shape {tuple(plan.params[i].shape)} has norm 0; "
                    "MuonHyperball requires every param to have non-zero norm"
                )
            if radius is not None:
                with torch.no_grad():
                    local_tensor(plan.params[i]).mul_(radius / norm.clamp_min(eps))

    @contextmanager
    def _around_orthogonalization(self, plan: OptimizerPlan, active: list[bool]) -> Iterator[None]:
        """Before NS each matrix's radius; after every update each weight scaled back to it."""
        indices = [m.matrix.param for m in plan.step_plan.matrices if active[m.matrix.param]]
        radius = self.reference.hyperball_radius
        radii = [radius] * len(indices) if radius is not None else None
        if radii is None:  # the weights' norms after weight decay, as MuonHyperball's pre hook
            radii = self._whole_norms(plan, indices).tolist()
        self._radius = {id(plan.params[i]): r for i, r in zip(indices, radii, strict=True)}
        with super()._around_orthogonalization(plan, active):
            yield
        eps = self.reference.hyperball_eps
        for i, norm in zip(indices, self._whole_norms(plan, indices), strict=True):
            local_tensor(plan.params[i]).mul_(
                self._radius[id(plan.params[i])] / norm.clamp_min(eps)
            )

    def _finish_matrix(self, param: torch.Tensor, group: dict, full: torch.Tensor) -> torch.Tensor:
        """MuonHyperball's pre hook on the whole update (owner): scaled to the radius."""
        eps = self.reference.hyperball_eps
        full.mul_(self._radius[id(param)] / full.norm().clamp_min(eps))
        return full


class ShardedSinkhornMuon(ShardedOrthogonalized):
    """SinkhornMuon: its post hook (the Sinkhorn-Knopp mapping) on the owner's full weight; its
    constructor's check of the params with whole-weight column sums (module docstring).

    Construction is collective over ``dp_group``.

    Raises:
        ValueError: as ``ShardedOrthogonalized``; a param with a negative element or not
            Sinkhorn-normalized within ``doubly_stochastic_tolerance`` (as SinkhornMuon).
    """

    name = "sinkhorn_muon"
    handled_hooks = _POST_HOOK
    post_update_on_owner = True

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self._check_sinkhorn_normalized(self._step_plan())

    def _check_sinkhorn_normalized(self, plan: OptimizerPlan) -> None:
        columns, extremes = [], []
        for i, param in enumerate(plan.params):
            local = local_tensor(param)
            row_target, _ = _targets(*param.shape)
            mine = counts_rows(plan, i)
            columns.append(local.sum(dim=0) if mine else local.new_zeros(param.shape[1]))
            if mine and local.shape[0] > 0:
                row_deviation = (local.sum(dim=-1) - row_target).abs().max()
                extremes.append(torch.stack([row_deviation, -local.min()]))
            else:
                extremes.append(local.new_full((2,), -math.inf))
        if not columns:
            return
        column_sums, maxima = torch.cat(columns), torch.stack(extremes)
        self._all_reduce(plan, column_sums)
        self._all_reduce(plan, maxima, dist.ReduceOp.MAX)
        tolerance = self.reference.doubly_stochastic_tolerance
        sizes = [p.shape[1] for p in plan.params]
        for i, (param, sums, (row_deviation, negated_min)) in enumerate(
            zip(plan.params, column_sums.split(sizes), maxima, strict=True)
        ):
            label = f"{self.label}: param {i} of shape {tuple(param.shape)}"
            if -negated_min < 0:
                raise ValueError(
                    f"{label} has negative values (min={-negated_min.item():.6f}); "
                    "Sinkhorn-normalized matrices must have non-negative entries"
                )
            row_target, column_target = _targets(*param.shape)
            column_deviation = (sums - column_target).abs().max()
            if row_deviation > tolerance or column_deviation > tolerance:
                raise ValueError(
                    f"{label} is not Sinkhorn-normalized: row sums {row_target:.4f} "
                    f"(deviation {row_deviation.item():.6f}), column sums {column_target:.4f} "
                    f"(deviation {column_deviation.item():.6f}), tolerance {tolerance} "
                    "(initialize it with emerging_optimizers' SinkhornMapper)"
                )


def _targets(rows: int, cols: int) -> tuple[float, float]:
    """SinkhornMapper's (row sum, column sum) targets of a ``(rows, cols)`` matrix."""
    return (cols / rows, 1.0) if cols > rows else (1.0, rows / cols)


#: ``OrthogonalizedOptimizerT`` name -> its adapter.
SHARDED_ORTHOGONALIZED: dict[str, type[ShardedOrthogonalized]] = {
    adapter.name: adapter
    for adapter in (
        ShardedPolarGrad,
        ShardedScion,
        ShardedMOP,
        ShardedSpel,
        ShardedMuonHyperball,
        ShardedSinkhornMuon,
    )
}
assert set(SHARDED_ORTHOGONALIZED) == set(get_args(OrthogonalizedOptimizerT)), "an adapter each"

"""ShardedAdaptiveMuon: emerging-optimizers' ``AdaptiveMuon`` exact on Megatron-FSDP's row shards.

``AdaptiveMuon`` (``--optimizer adaptive_muon``) is Muon with a second moment applied to the raw
Newton-Schulz output, before Muon's scale: per matrix, ``update = scale * moment2_fn(NS(m))``.
``ShardedAdaptiveMuon`` runs ``ShardedMuon``'s step (momentum on each rank's rows, NS of each full
matrix on its owner, the update applied to each rank's rows) and adds the second moment where its
method lets it live, calling ``AdaptiveMuon``'s own ``_apply_moment2_normalization`` and
``_apply_muon_scale`` (inherited, not copied):

- ``"adamuon"``: elementwise; its state is a DTensor like the param (``AdaptiveMuon._init_group``
  on a DTensor param), applied to each rank's rows of the raw NS result, no communication.
- ``"normuon"``: a mean along the longer side, then the raw result's Frobenius norm restored: it
  needs the whole matrix, so it runs on the owner, on the full matrix, inside the owner pipeline
  (``ShardedMuon._finish_matrix``). Its state (``(rows, 1)`` or ``(1, cols)``, plain tensors of the
  global shape, replicated) is updated there, then copied from the owners to every rank in one
  all_reduce per step (``moment2_partitions.share_states``: exact).
- ``"namo"``: a scalar from the Frobenius norms of the raw gradient and of the NS input. Each
  rank's sums of squares are summed over ``dp_group`` in one all_reduce per step, before NS; every
  rank then updates its replicated ``(1,)`` state identically and scales its rows. The function is
  ``AdaptiveMuon``'s, given one-element tensors holding the global norms (the norm of a
  one-element tensor is its absolute value).

``AdaptiveMuon``'s functions are eager (emerging-optimizers 0.3.0 compiles Lion's and Adam's
update functions, not these) and get plain tensors: local rows (``local_tensor``), the owner's
full matrix, or the replicated state; never a DTensor whose global shape differs from its rows.

Tensor parallelism: megatron-core's ``TensorParallelAdaptiveMuon`` (fixed by
``integrations.adaptive_muon_fix``) applies the second moment and Muon's scale to what its
``orthogonalize`` returns, the TP rank's partition: under tp_mode duplicated / distributed the
partition of the unsplit matrix's raw NS, under blockwise the partition's own NS, under both scaled
by the partition's shape (``_apply_muon_scale(update, update.size(-2), update.size(-1))``).
``ShardedAdaptiveMuon`` computes the same: NS as ``ShardedMuon`` (``TensorParallelMuon``'s
``orthogonalize`` with the unscaled ``raw_orthogonalize_fn``; layer_sharded is duplicated's update),
then the second moment per TP partition: adamuon elementwise on each rank's rows; normuon on the
owner's partition (under layer_sharded on each partition of the unsplit NS result, the views
duplicated's ``newton_schulz_tp`` takes: bitwise duplicated's); namo with each partition's norms
(the sums of squares over ``dp_group`` are the partition's); each with its partition's state
(``moment2_partitions``: every partition's, stacked along dim 0, on every rank); Muon's scale by
the partition's shape (``moment2_partitions.partitions_of``).

Refused at build time (``ValueError`` naming the setting): params that are not 2-D (as
``AdaptiveMuon``), ``"namo"`` with L2 weight decay (as ``AdaptiveMuon``), and a
``min_split_flops`` other than the default (NS is never split over ranks here: the second moment
needs the whole matrix on one rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from emerging_optimizers.orthogonalized_optimizers.adaptive_muon import AdaptiveMuon
from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz_tp
from torch.optim.optimizer import ParamsT

from megatron_muon.engine.config import MuonConfig, MuonFsdpConfig
from megatron_muon.engine.layout import local_tensor
from megatron_muon.engine.optimizer_plan import OptimizerPlan
from megatron_muon.engine.planner import MIN_SPLIT_FLOPS
from megatron_muon.engine.tensor_parallel import stock_tp_mode
from megatron_muon.newton_schulz.methods import NSConfig
from megatron_muon.optimizers.adaptive_muon_config import AdaptiveMuonConfig
from megatron_muon.optimizers.moment2_partitions import (
    Partitions,
    partitions_of,
    share_states,
    state_shape,
)
from megatron_muon.optimizers.muon import ShardedMuon

__all__ = ["ShardedAdaptiveMuon", "raw_orthogonalize_fn"]

# No matrix's NS is split over ranks: the second moment needs each whole matrix on one rank.
_NEVER_SPLIT = 2**62


def raw_orthogonalize_fn(num_ns_steps: int, coefficient_type: str, tp_mode: str) -> Any:
    """``TensorParallelMuon``'s ``scaled_orthogonalize_fn(grad, tp_group, partition_dim)``
    without Muon's scale (``AdaptiveMuon`` scales after the second moment): ``newton_schulz_tp``
    called as ``TensorParallelMuon`` calls it (blockwise runs as duplicated on a partition_dim of
    None). Returns the TP rank's partition ``grad``'s shape, fp32."""
    mode = "duplicated" if tp_mode in ("blockwise", "layer_sharded") else tp_mode

    def orthogonalize(
        grad: torch.Tensor, tp_group: Any, partition_dim: int | None = None
    ) -> torch.Tensor:
        return newton_schulz_tp(
            grad,
            steps=num_ns_steps,
            coefficient_type=coefficient_type,
            tp_group=tp_group,
            partition_dim=partition_dim,
            tp_mode=mode,
        )

    return orthogonalize


@dataclass(frozen=True, slots=True)
class _UnscaledNSConfig(NSConfig):
    """``NSConfig`` whose NS results are not scaled (``AdaptiveMuon`` scales after moment2)."""

    def shape_scale(self, rows: int, cols: int) -> float:
        return 1.0


class ShardedAdaptiveMuon(ShardedMuon, AdaptiveMuon):
    """``AdaptiveMuon`` on data-parallel row-sharded params (module docstring).

    Args:
        params: as ``ShardedMuon``'s, 2-D only.
        lr, weight_decay, muon, fsdp: ``ShardedMuon``'s; ``fsdp.min_split_flops`` must be left
            at its default (NS is never split here).
        adaptive: the second moment's method, beta2 and eps (default ``AdaptiveMuonConfig()``).
        **kwargs: ``ShardedMuon``'s other keywords (``dp_group``, ``pg_collection``, ...).

    State per param on every rank: ``momentum_buffer`` (like the param) and ``moment2_buffer``
    (like the param for adamuon; for normuon and namo a plain tensor, the same on every rank:
    ``AdaptiveMuon``'s ``(rows, 1)`` / ``(1, cols)`` / ``(1,)`` of the matrix, or with tensor
    parallelism of each TP partition, stacked along dim 0, ``moment2_partitions``).

    Raises:
        ValueError: a setting this class cannot run exactly (module docstring), or one that
            ``ShardedMuon`` or ``AdaptiveMuonConfig`` refuses.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-4,
        weight_decay: float = 0.01,
        *,
        adaptive: AdaptiveMuonConfig | None = None,
        muon: MuonConfig | None = None,
        fsdp: MuonFsdpConfig | None = None,
        **kwargs: Any,
    ) -> None:
        adaptive = adaptive or AdaptiveMuonConfig()
        fsdp = fsdp if fsdp is not None else MuonFsdpConfig()
        if fsdp.min_split_flops not in (MIN_SPLIT_FLOPS, _NEVER_SPLIT):
            raise ValueError(
                "ShardedAdaptiveMuon never splits a matrix's NS over ranks (its second moment "
                f"needs the whole matrix on one rank): min_split_flops={fsdp.min_split_flops} "
                "does not apply"
            )
        if adaptive.moment2_method == "namo" and not kwargs.get("use_decoupled_weight_decay", True):
            raise ValueError('moment2_method="namo" needs decoupled weight decay (as AdaptiveMuon)')
        # Read by _init_group, which ShardedMuon's constructor runs.
        self.moment2_method = adaptive.moment2_method
        self._partitions: dict[torch.Tensor, Partitions] = {}
        self._computed: dict[torch.Tensor, list[int]] = {}
        self._groups: dict[torch.Tensor, dict] = {}
        fsdp = replace(fsdp, min_split_flops=_NEVER_SPLIT)
        super().__init__(params, lr, weight_decay, muon=muon, fsdp=fsdp, **kwargs)
        # NS through TensorParallelMuon.orthogonalize (TP-split matrices) unscaled as well.
        self.scaled_orthogonalize_fn = raw_orthogonalize_fn(
            self.muon_config.num_ns_steps,
            self.muon_config.coefficient_type,
            stock_tp_mode(self.tp_mode),
        )
        # Muon's scale is applied once, after the second moment (AdaptiveMuon._apply_muon_scale).
        self.scale_mode = self.ns_config.scale_mode
        self.extra_scale_factor = self.ns_config.extra_scale_factor
        ns_fields = {f.name: getattr(self.ns_config, f.name) for f in fields(NSConfig)}
        self.ns_config = _UnscaledNSConfig(**{**ns_fields, "extra_scale_factor": 1.0})
        self.defaults.update(beta2=adaptive.beta2, eps=adaptive.eps)
        for group in self.param_groups:
            group.setdefault("beta2", adaptive.beta2)
            group.setdefault("eps", adaptive.eps)
        self._namo: dict[torch.Tensor, tuple[torch.Tensor, dict]] = {}
        self._namo_scales: dict[torch.Tensor, torch.Tensor] = {}

    def _parts(self, param: torch.Tensor) -> Partitions:
        """How tensor parallelism splits ``param`` (``moment2_partitions``), kept per param."""
        parts = self._partitions.get(param)
        if parts is None:
            parts = self._partitions[param] = partitions_of(param, self.dp_group)
        return parts

    def _group_of(self, param: torch.Tensor) -> dict:
        """The param group holding ``param``."""
        group = self._groups.get(param)
        if group is None:
            self._groups = {p: g for g in self.param_groups for p in g["params"]}
            group = self._groups[param]
        return group

    def _partition_shape(self, param: torch.Tensor) -> tuple[int, int]:
        """The shape Muon's scale is computed from: the TP partition's."""
        parts = self._parts(param)
        return parts.rows, parts.cols

    @torch.no_grad()
    def _init_group(self, group: dict, skip_non_grad_params: bool = True) -> None:
        """``AdaptiveMuon._init_group``; normuon's and namo's new state then holds one block per
        TP partition (``moment2_partitions.state_shape``; AdaptiveMuon's own without TP)."""
        new = [p for p in group["params"] if not self.state[p]]
        super()._init_group(group, skip_non_grad_params)
        if self.moment2_method == "adamuon":
            return
        for param in new:
            state = self.state[param]
            if "moment2_buffer" in state:
                shape = state_shape(self.moment2_method, self._parts(param))
                state["moment2_buffer"] = state["moment2_buffer"].new_zeros(shape)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``ShardedMuon.add_param_group``, refusing params that are not 2-D (``AdaptiveMuon``'s
        rule)."""
        super().add_param_group(param_group)
        for param in self.param_groups[-1]["params"]:
            if param.ndim != 2:
                self.param_groups.pop()
                raise ValueError(
                    f"ShardedAdaptiveMuon: param of shape {tuple(param.shape)} is not a matrix; "
                    "AdaptiveMuon takes 2-D params only"
                )

    # ---------------------------------------------------------------------------------------------
    # the hooks of ShardedMuon's step
    # ---------------------------------------------------------------------------------------------

    def _momentum_update(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        """``ShardedMuon``'s; for namo also this rank's sums of squares of the raw gradient and of
        the NS input rows (summed over ``dp_group`` before NS)."""
        update = super()._momentum_update(param, group)
        if self.moment2_method == "namo":
            raw = local_tensor(param.grad) if param.grad is not None else update.new_zeros(())
            sums = torch.stack([raw.float().square().sum(), update.float().square().sum()])
            self._namo[param] = (sums, group)
        return update

    @contextmanager
    def _around_orthogonalization(self, plan: OptimizerPlan, active: list[bool]) -> Iterator[None]:
        """namo: the partitions' norms and each matrix's scalar before NS; after NS, the new
        second moments (normuon: the owners'; namo: each TP rank's partition) to every rank.
        Collective over ``dp_group`` and the params' TP groups."""
        if self.moment2_method == "namo":
            self._namo_scales = self._namo_scalars(plan, active)
        yield
        if self.moment2_method != "adamuon":
            self._share_moment2(plan, active)

    def _finish_matrix(self, param: torch.Tensor, group: dict, full: torch.Tensor) -> torch.Tensor:
        """normuon on the raw NS result (owner): ``full`` is this rank's TP partition (or the
        unsplit matrix), its state block updated here; or under layer_sharded the partitions
        stacked along dim 0, normalized already (``_finish_unsplit``). Then Muon's scale by the
        partition's shape."""
        if self.moment2_method != "normuon":
            return full
        parts = self._parts(param)
        if full.shape[0] == parts.rows:
            moment2 = self.state[param]["moment2_buffer"].chunk(parts.count)[parts.index]
            full = self._apply_moment2_normalization(full, moment2, group["beta2"], group["eps"])
            self._computed[param] = [parts.index]
        elif len(self._computed.get(param, ())) != parts.count:  # never: _finish_unsplit ran
            raise RuntimeError(f"normuon: stacked partitions {tuple(full.shape)} not normalized")
        return self._apply_muon_scale(full, parts.rows, parts.cols)

    def _finish_unsplit(
        self, param: torch.Tensor, unsplit: torch.Tensor, partitions: int, dim: int
    ) -> torch.Tensor:
        """layer_sharded, normuon: each TP partition's second moment on the owner, on the very
        views duplicated's ``newton_schulz_tp`` hands the stock class (``unsplit.chunk(partitions,
        dim)``, strides included: the same reduction order), with its state block."""
        if self.moment2_method != "normuon":
            return unsplit
        group = self._group_of(param)
        blocks = self.state[param]["moment2_buffer"].chunk(partitions)
        updates = [
            self._apply_moment2_normalization(piece, block, group["beta2"], group["eps"])
            for piece, block in zip(unsplit.chunk(partitions, dim), blocks, strict=True)
        ]
        self._computed[param] = list(range(partitions))
        return torch.cat(updates, dim)

    def _apply_update(self, param: torch.Tensor, group: dict, update: torch.Tensor) -> None:
        """adamuon / namo on this rank's rows of the raw NS result, Muon's scale, the update."""
        if self.moment2_method == "adamuon":
            moment2 = local_tensor(self.state[param]["moment2_buffer"])
            update = update.view_as(moment2)
            update = self._apply_moment2_normalization(
                update, moment2, group["beta2"], group["eps"]
            )
        elif self.moment2_method == "namo":
            update = update * self._namo_scales.pop(param)
        if self.moment2_method != "normuon":
            update = self._apply_muon_scale(update, *self._partition_shape(param))
        super()._apply_update(param, group, update)

    # ---------------------------------------------------------------------------------------------
    # the collectives
    # ---------------------------------------------------------------------------------------------

    def _namo_scalars(
        self, plan: OptimizerPlan, active: list[bool]
    ) -> dict[torch.Tensor, torch.Tensor]:
        """Each active matrix's namo scalar ``alpha`` (``(1,)``), its second moment updated: one
        all_reduce of every matrix's two sums of squares over ``dp_group``."""
        params = [p for i, p in enumerate(plan.params) if active[i]]
        if not params:
            return {}
        entries = [self._namo.pop(p) for p in params]
        sums = torch.stack([s for s, _ in entries])
        if plan.runtime.num_ranks > 1:
            dist.all_reduce(sums, group=self.dp_group)
            self.step_stats.num_collectives += 1
        scalars = {}
        for param, (raw_sq, pre_sq), (_, group) in zip(params, sums, entries, strict=True):
            parts = self._parts(param)
            moment2 = self.state[param]["moment2_buffer"][parts.index : parts.index + 1]
            self._computed[param] = [parts.index]
            one = torch.ones(1, dtype=moment2.dtype, device=moment2.device)
            scalars[param] = self._apply_moment2_normalization(
                one,
                moment2,
                group["beta2"],
                group["eps"],
                raw_grad=raw_sq.sqrt().view(1).to(moment2.dtype),
                pre_orth_grad=pre_sq.sqrt().view(1).to(moment2.dtype),
            )
        return scalars

    def _share_moment2(self, plan: OptimizerPlan, active: list[bool]) -> None:
        """Every rank's normuon / namo states become the values computed this step
        (``moment2_partitions.share_states``): normuon's over ``dp_group`` in owner mode (the
        owner computed them) and over TP groups; namo's over TP groups only (every rank of a TP
        coordinate computed its partition's). One rank without TP: nothing to share."""
        params = [p for i, p in enumerate(plan.params) if active[i]]
        over_dp = (
            self.moment2_method == "normuon"
            and self.fsdp_config.mode == "owner"
            and plan.runtime.num_ranks > 1
        )
        parts = [self._parts(p) for p in params]
        if not over_dp and all(part.group is None for part in parts):
            self._computed.clear()
            return
        states = [self.state[p]["moment2_buffer"] for p in params]
        computed = [self._computed.get(p, []) for p in params]
        self._computed.clear()
        self.step_stats.num_collectives += share_states(
            states, computed, parts, self.dp_group, over_dp=over_dp
        )

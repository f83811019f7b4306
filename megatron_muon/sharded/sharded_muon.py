"""ShardedMuon: Muon that is exact on Megatron-FSDP's data-parallel row shards.

Megatron-FSDP hands the optimizer each weight as a DTensor sharded by whole rows over the
data-parallel group (uneven, sometimes empty, ``grad is None`` where a rank holds no rows).
Momentum, weight decay and the parameter update are elementwise, so they stay on each rank's own
rows; only Newton-Schulz (NS) needs the full matrix. One step is:

1. every rank walks every param in the same order (a rank with no rows holds a zero grad), applies
   weight decay and the momentum update to its own rows;
2. the 2-D matrices go through NS by the static plan (``step_plan``, built once from shapes and
   row layouts) run by the owner pipeline (``owner_pipeline``): ``mode="owner"`` (default) brings
   each matrix to its owner rank(s) with one batch of point-to-point messages per bucket, straight
   into the full matrices, and returns each holder its rows the same way; ``mode="gather"`` (a
   reference) all_gathers and orthogonalizes every matrix on every rank. 3-D expert tensors
   ``(E, out, in)`` are sharded by whole experts: each rank orthogonalizes its own experts with no
   communication (``ns_runner``);
3. each rank updates its own rows in place (placements and global shape untouched).

Orthogonalization semantics are megatron-core ``TensorParallelMuon``'s (scale modes, coefficient
types, NS steps, QKV split (``qkv``), tp_mode blockwise/duplicated/distributed; how tensor
parallelism meets the row shards: ``tensor_parallel``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from emerging_optimizers import utils as eo_utils
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
from torch.optim.optimizer import ParamsT

from megatron_muon.common.options import FsdpModeT, GramHalfDtypeT, MuonScaleT, TpModeT
from megatron_muon.newton_schulz.methods import NSCoeffT, NSConfig, NSMethodT, ns_flops
from megatron_muon.sharded.config import MuonConfig, MuonFsdpConfig
from megatron_muon.sharded.layout import check_same_params, gather_row_layouts, local_tensor
from megatron_muon.sharded.momentum_offload import MomentumOffload
from megatron_muon.sharded.ns_runner import NSRunner, StepStats
from megatron_muon.sharded.owner_pipeline import BucketRuntime
from megatron_muon.sharded.planner import MIN_SPLIT_FLOPS, OwnerPlan
from megatron_muon.sharded.qkv import qkv_split_shapes
from megatron_muon.sharded.step_plan import NSMatrix, StepPlan, plan_step
from megatron_muon.sharded.tensor_parallel import (
    check_ns_method,
    check_param_meshes,
    needs_tp_collectives,
    tp_group,
)

__all__ = ["ShardedMuon", "StepStats"]

# The megatron-muon keywords' defaults are MuonFsdpConfig's.
_FSDP_DEFAULTS = MuonFsdpConfig()


@dataclass(frozen=True, slots=True)
class _Plan:
    """What ``step()`` keeps between steps: the params it was built for, their static plan (2-D
    matrices), the positions of the 3-D expert params, and the runtime that runs the plan."""

    params: list[torch.Tensor]
    step_plan: StepPlan
    experts: list[int]
    runtime: BucketRuntime

    @staticmethod
    def build(muon: ShardedMuon, params: list[torch.Tensor]) -> _Plan:
        """Layouts (one all_gather), the static plan, and split-NS groups of ``muon``'s params.

        Collective over ``muon.dp_group`` (and, for split matrices, each split block's ranks).
        """
        # Without torch.distributed (one process) every param is whole: DP size 1.
        num_ranks = dist.get_world_size(muon.dp_group) if dist.is_initialized() else 1
        check_same_params(params, muon.dp_group)
        layouts = gather_row_layouts(params, muon.dp_group)
        matrices = [
            NSMatrix(
                param=i,
                layout=layouts[i],
                qkv_split_shapes=qkv_split_shapes(
                    param, muon.split_qkv, muon.is_qkv_fn, muon.qkv_split_shapes
                ),
                tp_collectives=needs_tp_collectives(param, muon.tp_mode, muon.pg_collection),
            )
            for i, param in enumerate(params)
            if param.ndim == 2
        ]
        step_plan = plan_step(
            matrices,
            num_ranks,
            muon.ns_config,
            bucket_size_bytes=muon.bucket_size_bytes,
            min_split_flops=muon.min_split_flops,
            owner_buckets=muon.mode == "owner",
        )
        return _Plan(
            params=params,
            step_plan=step_plan,
            experts=[i for i, p in enumerate(params) if p.ndim == 3],
            runtime=BucketRuntime(
                step_plan, muon.mode, muon.dp_group, num_ranks, muon.overlap_buckets
            ),
        )


class ShardedMuon(TensorParallelMuon):
    """Muon on data-parallel row-sharded params (Megatron-FSDP), exact and hang-free.

    Takes ``TensorParallelMuon``'s keywords with the same defaults, plus (those that
    ``MuonFsdpConfig`` holds with its defaults):

    Args:
        dp_group: process group the rows are sharded over: ``pg_collection.dp_cp`` for dense params,
            ``pg_collection.expt_dp`` for experts. ``None`` means the default (world) group.
        mode: ``"owner"`` (each full matrix orthogonalized once, by one owner rank) or
            ``"gather"`` (every rank gathers and orthogonalizes every matrix; a reference).
        bucket_size_bytes: bound on the fp32 bytes of full matrices one rank holds at once (the
            owner step's peak extra memory; buckets are exchanged and orthogonalized one after the
            other, in owner mode each giving every rank its next matrices:
            ``step_plan.bucket_by_owner_rounds``); ``None`` exchanges all matrices in one bucket.
            Default: 16 MiB (``config.DEFAULT_BUCKET_SIZE_BYTES``, chosen in docs/benchmarks.md).
        overlap_buckets: owner mode: the next bucket's rows travel while this bucket runs NS
            (``owner_pipeline``): up to two buckets' full matrices held at once; bitwise the same
            updates. Default off until measured (docs/benchmarks.md, "Overlap").
        ns_method: a method of the NS-method registry (``newton_schulz.NS_METHODS``), e.g.
            ``"standard"`` NS, ``"gram"`` (Gram Newton-Schulz) or ``"symmetric"``.
        custom_coefficient_sets: the ``(a, b, c)`` triples for ``coefficient_type="custom"``.
        gram_restarts, gram_half_dtype: Gram NS restarts and its half dtype under ``"medium"``
            precision (``NSConfig``; fp16 by default, which CPUs emulate slowly: use bfloat16
            there).
        offload_momentum: keep momentum in (pinned, on GPU machines) CPU memory between steps; it
            is brought back to the param's device for the step. Results are bitwise unchanged.
            Momentum stays resident from ``state_dict()`` until the end of the next step.
        min_split_flops: a matrix whose NS costs at least this many FLOPs may have its NS split
            over a small block of ranks when one owner per matrix cannot balance the load
            (``planner.plan_split_owners``); ``0`` allows splitting any matrix.

    Params: DTensors with ``Shard(0)`` or ``Replicate`` placements on their data-parallel mesh axes
    (1-D ``dp_group`` mesh, or the two axes of an HSDP mesh), plus, under tensor parallelism,
    ``Shard(partition_dim)`` on a tensor-parallel axis (Megatron-FSDP's ``(dp_cp, tp)`` mesh, global
    shape of the unsplit weight); or plain tensors (replicated over ``dp_group``); 2-D
    ``(out, in)`` matrices or 3-D ``(E, out, in)`` expert tensors (orthogonalized per expert).
    State (``momentum_buffer``, like the param) exists for every param on every rank from
    construction on, so checkpoint keys are the same on every rank.

    Raises:
        ValueError: bad keywords (checked by ``MuonConfig``, ``MuonFsdpConfig`` and ``NSConfig``);
            a param that is not a matrix; a DTensor whose data-parallel mesh axes are not
            ``dp_group``, or, with tp_mode duplicated/distributed, whose tensor-parallel axis is
            not ``pg_collection.tp`` (``expt_tp``) or does not split ``partition_dim``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-4,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.01,
        use_decoupled_weight_decay: bool = True,
        split_qkv: bool = False,
        is_qkv_fn: Callable[[torch.Tensor], bool] | None = None,
        qkv_split_shapes: list[int] | None = None,
        fp32_matmul_prec: str = "medium",
        coefficient_type: NSCoeffT = "quintic",
        num_ns_steps: int = 5,
        scale_mode: MuonScaleT = "spectral",
        extra_scale_factor: float = 1.0,
        pg_collection: Any = None,
        tp_mode: TpModeT = "duplicated",
        *,
        dp_group: dist.ProcessGroup | None = None,
        mode: FsdpModeT = _FSDP_DEFAULTS.mode,
        bucket_size_bytes: int | None = _FSDP_DEFAULTS.bucket_size_bytes,
        overlap_buckets: bool = _FSDP_DEFAULTS.overlap_buckets,
        ns_method: NSMethodT = _FSDP_DEFAULTS.ns_method,
        custom_coefficient_sets: list[tuple[float, float, float]] | None = None,
        gram_restarts: tuple[int, ...] | None = _FSDP_DEFAULTS.gram_restarts,
        gram_half_dtype: GramHalfDtypeT = _FSDP_DEFAULTS.gram_half_dtype,
        offload_momentum: bool = _FSDP_DEFAULTS.offload_momentum,
        min_split_flops: int = MIN_SPLIT_FLOPS,
    ) -> None:
        # Refused at construction: values that would step uphill or fail only at the first step.
        # The Muon and megatron-muon keywords are checked by their configs (config.py).
        if not lr >= 0.0:  # also NaN
            raise ValueError(f"lr must be >= 0, got {lr}")
        MuonConfig(
            momentum=momentum,
            split_qkv=split_qkv,
            nesterov=nesterov,
            scale_mode=scale_mode,
            fp32_matmul_prec=fp32_matmul_prec,
            coefficient_type=coefficient_type,
            num_ns_steps=num_ns_steps,
            tp_mode=tp_mode,
            extra_scale_factor=extra_scale_factor,
        )
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        MuonFsdpConfig(
            mode=mode,
            bucket_size_bytes=bucket_size_bytes,
            ns_method=ns_method,
            gram_half_dtype=gram_half_dtype,
            gram_restarts=gram_restarts,
            offload_momentum=offload_momentum,
        )
        if split_qkv and is_qkv_fn is None:
            raise ValueError("split_qkv=True needs is_qkv_fn to tell which params are QKV weights")
        super().__init__(
            params,
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            use_decoupled_weight_decay=use_decoupled_weight_decay,
            split_qkv=split_qkv,
            is_qkv_fn=is_qkv_fn,
            qkv_split_shapes=qkv_split_shapes,
            fp32_matmul_prec=fp32_matmul_prec,
            coefficient_type=coefficient_type,
            num_ns_steps=num_ns_steps,
            scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor,
            pg_collection=pg_collection,
            tp_mode=tp_mode,
        )
        self.ns_config = NSConfig(
            num_ns_steps=num_ns_steps,
            coefficient_type=coefficient_type,
            scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor,
            ns_method=ns_method,
            custom_coefficient_sets=(
                tuple(custom_coefficient_sets) if custom_coefficient_sets is not None else None
            ),
            gram_restarts=gram_restarts,
            gram_half_dtype=gram_half_dtype,
        )
        check_ns_method(self.ns_config, tp_mode, pg_collection)
        self.dp_group = dp_group
        self.mode: FsdpModeT = mode
        self.bucket_size_bytes = bucket_size_bytes
        self.overlap_buckets = overlap_buckets
        self.offload_momentum = offload_momentum
        self.min_split_flops = min_split_flops
        self.step_stats = StepStats()
        self._offload = MomentumOffload()
        self._plan: _Plan | None = None
        check_param_meshes(self._all_params(), dp_group, tp_mode, pg_collection)
        for group in self.param_groups:
            self._init_group(group, skip_non_grad_params=False)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group`` (also used by the constructor), refusing params that
        ShardedMuon cannot orthogonalize; nothing is added when one is refused.

        The new params' state is created by the next ``step()`` (locally, without a collective);
        that step is collective over ``dp_group`` as always, so every rank adds the same group.

        Raises:
            ValueError: a param that is not 2-D or 3-D, or has a complex dtype (Newton-Schulz
                runs on real matrices; a cast would drop the imaginary part).
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        first = sum(len(g["params"]) for g in self.param_groups[:-1])
        names = group.get("param_names") or [None] * len(group["params"])
        for index, (param, name) in enumerate(zip(group["params"], names, strict=True)):
            problem = _param_problem(param)
            if problem is not None:
                self.param_groups.pop()
                label = f"param {first + index}" + (f" ({name})" if name else "")
                raise ValueError(f"ShardedMuon: {label} {problem}")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """One Muon step. Collective over ``dp_group``: every rank must call it."""
        if closure is not None:
            raise ValueError("closure is not supported")
        plan = self._step_plan()
        self.step_stats = StepStats()
        # State missing for a param added by add_param_group, or loaded from an optimizer that
        # never stepped it (TensorParallelMuon creates state lazily): zeros, on each rank alone.
        for group in self.param_groups:
            self._init_group(group, skip_non_grad_params=False)
        groups = [g for g in self.param_groups for _ in g["params"]]
        active = plan.runtime.params_with_grad_anywhere(plan.params, self.step_stats)
        self._offload.bring_back()
        inputs = {
            i: self._momentum_update(param, groups[i])
            for i, param in enumerate(plan.params)
            if active[i]
        }

        def finalize(i: int, update: torch.Tensor) -> None:
            self._apply_update(plan.params[i], groups[i], update)

        runner = NSRunner(
            self.ns_config,
            self.step_stats,
            lambda matrix, full: self._tp_orthogonalize(plan.params[matrix.param], full),
            lambda m, full: self._finish_matrix(plan.params[m.param], groups[m.param], full),
        )
        experts = [i for i in plan.experts if i in inputs]
        precision = eo_utils.fp32_matmul_precision(self.fp32_matmul_prec)
        with precision, self._around_orthogonalization(plan, active):
            # Whole experts per rank: NS of the local experts, no communication.
            updates = runner.experts([inputs[i].float() for i in experts])
            for i, update in zip(experts, updates, strict=True):
                finalize(i, update)
            plan.runtime.run(
                [active[m.matrix.param] for m in plan.step_plan.matrices],
                prepare=lambda m: inputs[m.matrix.param].float(),
                compute=runner,
                finalize=lambda m, update: finalize(m.matrix.param, update),
                stats=self.step_stats,
            )
        if self.offload_momentum:
            momenta = (self.state[p]["momentum_buffer"] for p in self._all_params())
            self._offload.offload(local_tensor(m) for m in momenta)
        return None

    def _momentum_update(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        """Weight decay and momentum on this rank's rows; returns the NS input rows."""
        local = local_tensor(param)
        grad = local_tensor(param.grad) if param.grad is not None else torch.zeros_like(local)
        self._apply_weight_decay_inplace(local, grad, group["lr"], group["weight_decay"])
        buffer = local_tensor(self.state[param]["momentum_buffer"])
        buffer.lerp_(grad, 1 - group["momentum"])
        if self.nesterov:
            return grad.lerp(buffer, group["momentum"])
        return buffer

    def _finish_matrix(self, param: torch.Tensor, group: dict, full: torch.Tensor) -> torch.Tensor:
        # Hook: after NS, on the rank holding the whole fp32 matrix; Muon's update is NS's result.
        return full

    def _around_orthogonalization(self, plan: _Plan, active: list[bool]) -> AbstractContextManager:
        # Hook: a subclass's collectives over dp_group before and after NS (Muon: none).
        return nullcontext()

    def _apply_update(self, param: torch.Tensor, group: dict, update: torch.Tensor) -> None:
        """``param -= lr * update`` on this rank's rows (``update``: those rows, fp32)."""
        local = local_tensor(param)
        update = update.view_as(local).to(local.dtype)
        self.pre_weight_update_fn_inplace(local, update)
        local.add_(update, alpha=-group["lr"])
        self.post_weight_update_fn_inplace(local)

    def _tp_orthogonalize(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """``TensorParallelMuon.orthogonalize`` of a DP-full, TP-partitioned matrix (TP
        collectives over its TP group); counts the FLOPs each TP rank runs."""
        result = self.orthogonalize(param, full)
        copies = dist.get_world_size(tp_group(param, self.pg_collection))
        flops = ns_flops(full.shape[0], full.shape[1], self.ns_config.num_ns_steps)
        self.step_stats.ns_flops += flops * (copies if self.tp_mode == "duplicated" else 1)
        return result

    def bring_momentum_back(self) -> None:
        """Makes offloaded momentum resident again (before anything reads or writes ``state``
        directly, as ``megatron_muon.checkpointing`` does); the next step offloads it again."""
        self._offload.bring_back()

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state with every momentum resident (offloaded momentum brought back)."""
        self._offload.bring_back()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads state; offload bookkeeping restarts from the loaded (resident) tensors."""
        self._offload.bring_back()
        self._offload.forget()
        super().load_state_dict(state_dict)

    def owner_plan(self) -> OwnerPlan:
        """The owner of each 2-D matrix (in param order); builds the plan if needed (collective)."""
        return self._step_plan().step_plan.owner_plan

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _step_plan(self) -> _Plan:
        """The plan of the current params: kept while they are the same tensors, else rebuilt."""
        params = self._all_params()
        plan = self._plan
        if (
            plan is None
            or len(plan.params) != len(params)
            or not all(a is b for a, b in zip(plan.params, params, strict=True))
        ):
            plan = self._plan = _Plan.build(self, params)
        return plan


def _param_problem(param: torch.Tensor) -> str | None:
    """Why ``ShardedMuon`` cannot orthogonalize ``param`` (``None``: it can)."""
    if param.is_complex():
        return f"has complex dtype {param.dtype}; Newton-Schulz needs a real matrix"
    if param.ndim not in (2, 3):
        return (
            f"has shape {tuple(param.shape)} ({param.ndim}-D); ShardedMuon "
            "orthogonalizes matrices: route it to the scalar optimizer"
        )
    return None

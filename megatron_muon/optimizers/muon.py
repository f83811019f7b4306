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
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from emerging_optimizers import utils as eo_utils
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
from torch.optim.optimizer import ParamsT

from megatron_muon.engine.config import MuonConfig, MuonFsdpConfig
from megatron_muon.engine.layout import local_tensor
from megatron_muon.engine.momentum_offload import MomentumOffload
from megatron_muon.engine.ns_runner import NSRunner, StepStats
from megatron_muon.engine.optimizer_plan import OptimizerPlan
from megatron_muon.engine.planner import OwnerPlan
from megatron_muon.engine.qkv import qkv_pieces
from megatron_muon.engine.step_plan import NSMatrix
from megatron_muon.engine.tensor_parallel import (
    check_ns_method,
    check_param_meshes,
    stock_tp_mode,
    tp_group,
)
from megatron_muon.engine.tp_grid import join_partitions, orthogonalize_unsplit, stack_partitions
from megatron_muon.newton_schulz.cost_model import pieces_flops
from megatron_muon.optimizers.muon_keywords import configs_of_keywords, deprecated_flat_keywords

__all__ = ["ShardedMuon", "StepStats"]


class ShardedMuon(TensorParallelMuon):
    """Muon on data-parallel row-sharded params (Megatron-FSDP), exact and hang-free.

    Args:
        params: the params (or param groups) below.
        lr, weight_decay: as ``TensorParallelMuon``'s (per param group).
        muon: Megatron's Muon settings (``MuonConfig``: momentum, Nesterov, NS steps and
            coefficients, scale, fp32 matmul precision, QKV split, tp_mode), handed to
            ``TensorParallelMuon``. Default: ``MuonConfig(split_qkv=False)`` (megatron-core's
            ``OptimizerConfig`` defaults; the QKV split needs ``is_qkv_fn``).
        fsdp: megatron-muon's settings (``MuonFsdpConfig``: owner/gather mode, exchange buckets
            and their overlap, NS method and Gram settings, custom NS coefficients, momentum
            offload, split threshold). Default: ``MuonFsdpConfig()``.
        dp_group: process group the rows are sharded over: ``pg_collection.dp_cp`` for dense params,
            ``pg_collection.expt_dp`` for experts. ``None`` means the default (world) group.
        pg_collection: megatron-core process groups; ``tp`` / ``expt_tp`` for tensor parallelism
            (``TensorParallelMuon``'s).
        is_qkv_fn, qkv_split_shapes: which params are fused QKV weights and their split
            (``TensorParallelMuon``'s; ``is_qkv_fn`` is required with ``muon.split_qkv``).
        use_decoupled_weight_decay: ``TensorParallelMuon``'s (Megatron always decouples).

    ``ShardedMuon.from_keywords`` builds one from ``TensorParallelMuon``'s flat keywords. The
    constructor of 0.1, ``ShardedMuon(params, momentum=..., mode=...)`` (those flat keywords in
    place of ``muon=`` and ``fsdp=``), still works for 0.2 with a ``DeprecationWarning``.

    Params: DTensors with ``Shard(0)`` or ``Replicate`` placements on their data-parallel mesh axes
    (1-D ``dp_group`` mesh, or the two axes of an HSDP mesh), plus, under tensor parallelism,
    ``Shard(partition_dim)`` on a tensor-parallel axis (Megatron-FSDP's ``(dp_cp, tp)`` mesh, global
    shape of the unsplit weight); or plain tensors (replicated over ``dp_group``); 2-D
    ``(out, in)`` matrices or 3-D ``(E, out, in)`` expert tensors (orthogonalized per expert).
    State (``momentum_buffer``, like the param) exists for every param on every rank from
    construction on, so checkpoint keys are the same on every rank.

    Raises:
        ValueError: a negative lr or weight decay; settings refused by ``MuonConfig``,
            ``MuonFsdpConfig`` or their combination (``MuonFsdpConfig.ns_config``);
            ``split_qkv`` without ``is_qkv_fn``; a param that is not a matrix; a DTensor whose
            data-parallel mesh axes are not ``dp_group``, or, with tp_mode
            duplicated/distributed, whose tensor-parallel axis is not ``pg_collection.tp``
            (``expt_tp``) or does not split ``partition_dim``.
    """

    #: Whether every matrix goes whole through ``self.orthogonalize`` on its owner, never split
    #: (``NSMatrix.own_orthogonalize``; the other emerging optimizers, ``orthogonalized``).
    own_orthogonalize: ClassVar[bool] = False

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-4,
        weight_decay: float = 0.01,
        *,
        muon: MuonConfig | None = None,
        fsdp: MuonFsdpConfig | None = None,
        dp_group: dist.ProcessGroup | None = None,
        pg_collection: Any = None,
        is_qkv_fn: Callable[[torch.Tensor], bool] | None = None,
        qkv_split_shapes: list[int] | None = None,
        use_decoupled_weight_decay: bool = True,
        **flat_keywords: Any,
    ) -> None:
        if flat_keywords:  # 0.1's constructor: deprecated, removed in 0.3.0
            muon, fsdp = deprecated_flat_keywords(flat_keywords, muon, fsdp)
        # Refused at construction: values that would step uphill or fail only at the first step.
        # Every other setting was checked by its config when that was built.
        if not lr >= 0.0:  # also NaN
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        muon = muon if muon is not None else MuonConfig(split_qkv=False)
        fsdp = fsdp if fsdp is not None else MuonFsdpConfig()
        if muon.split_qkv and is_qkv_fn is None:
            raise ValueError("split_qkv=True needs is_qkv_fn to tell which params are QKV weights")
        self.ns_config = fsdp.ns_config(muon)
        check_ns_method(self.ns_config, muon.tp_mode, pg_collection)
        super().__init__(
            params,
            lr=lr,
            weight_decay=weight_decay,
            use_decoupled_weight_decay=use_decoupled_weight_decay,
            is_qkv_fn=is_qkv_fn,
            qkv_split_shapes=qkv_split_shapes,
            pg_collection=pg_collection,
            # Stock TensorParallelMuon knows blockwise/duplicated/distributed only: layer_sharded
            # runs its NS as duplicated does, on the unsplit matrix (tp_grid).
            **{**muon.tensor_parallel_muon_kwargs(), "tp_mode": stock_tp_mode(muon.tp_mode)},
        )
        self.tp_mode = muon.tp_mode
        self.muon_config = muon
        self.fsdp_config = fsdp
        self.dp_group = dp_group
        self.step_stats = StepStats()
        self._offload = MomentumOffload()
        self._plan: OptimizerPlan | None = None
        check_param_meshes(self._all_params(), dp_group, muon.tp_mode, pg_collection)
        for group in self.param_groups:
            self._init_group(group, skip_non_grad_params=False)

    @classmethod
    def from_keywords(
        cls, params: ParamsT, lr: float = 3e-4, weight_decay: float = 0.01, **keywords: Any
    ) -> ShardedMuon:
        """A ``ShardedMuon`` from ``TensorParallelMuon``'s flat keywords, with its defaults.

        ``keywords``: ``TensorParallelMuon``'s (``momentum=``, ``nesterov=``, ... go to the
        ``MuonConfig``, whose unnamed fields take ``TensorParallelMuon``'s defaults, e.g.
        ``nesterov=True``, ``tp_mode="duplicated"``), ``MuonFsdpConfig`` fields (``mode=``, ...)
        and ``ShardedMuon``'s other keywords (``dp_group=``, ...): each by its name.

        Raises:
            TypeError: a keyword that names none of these.
        """
        muon, fsdp, others = configs_of_keywords(keywords)
        return cls(params, lr=lr, weight_decay=weight_decay, muon=muon, fsdp=fsdp, **others)

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
            lambda matrix, full: self._tp_orthogonalize(plan.params[matrix.param], matrix, full),
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
        if self.fsdp_config.offload_momentum:
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

    def _finish_unsplit(
        self, param: torch.Tensor, unsplit: torch.Tensor, partitions: int, dim: int
    ) -> torch.Tensor:
        # Hook: layer_sharded, on the owner, NS's result of the unsplit matrix (its TP partitions
        # along dim, as duplicated's newton_schulz_tp chunks it), before they are stacked.
        return unsplit

    def _around_orthogonalization(
        self, plan: OptimizerPlan, active: list[bool]
    ) -> AbstractContextManager:
        # Hook: a subclass's collectives over dp_group before and after NS (Muon: none).
        return nullcontext()

    def _apply_update(self, param: torch.Tensor, group: dict, update: torch.Tensor) -> None:
        """``param -= lr * update`` on this rank's rows (``update``: those rows, fp32)."""
        local = local_tensor(param)
        update = update.view_as(local).to(local.dtype)
        self.pre_weight_update_fn_inplace(local, update)
        local.add_(update, alpha=-group["lr"])
        self.post_weight_update_fn_inplace(local)

    def _tp_orthogonalize(
        self, param: torch.Tensor, matrix: NSMatrix, full: torch.Tensor
    ) -> torch.Tensor:
        """``TensorParallelMuon``'s NS of a ``stock_ns`` matrix: under layer_sharded the stacked
        TP partitions, unsplit here (``tp_grid``); else the DP-full TP partition through
        ``orthogonalize`` (TP collectives over its TP group). Counts the FLOPs this rank runs:
        the unsplit matrix's NS (duplicated, layer_sharded), or a TP rank's share (distributed).
        """
        count, dim = matrix.tp_partitions, matrix.tp_partition_dim
        if count > 1:
            unsplit = orthogonalize_unsplit(
                lambda g: self.scaled_orthogonalize_fn(g, None, None),
                join_partitions(full, count, dim),
                matrix.qkv_split_shapes,
            )
            unsplit = self._finish_unsplit(param, unsplit, count, dim)
            result, (rows, cols) = stack_partitions(unsplit, count, dim), matrix.ns_shape
        else:
            result = self.orthogonalize(param, full)
            count = dist.get_world_size(tp_group(param, self.pg_collection))
            # TensorParallelMuon joins the TP partitions along partition_dim (0 or 1).
            shape = [*full.shape]
            shape[param.partition_dim] *= count  # type: ignore[attr-defined]  # Megatron's attr
            rows, cols = shape
        flops = pieces_flops(qkv_pieces(rows, cols, matrix.qkv_split_shapes), self.ns_config)
        self.step_stats.ns_flops += flops // count if self.tp_mode == "distributed" else flops
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

    def _step_plan(self) -> OptimizerPlan:
        """The plan of the current params: kept while they are the same tensors, else rebuilt."""
        params = self._all_params()
        plan = self._plan
        if (
            plan is None
            or len(plan.params) != len(params)
            or not all(a is b for a, b in zip(plan.params, params, strict=True))
        ):
            plan = self._plan = OptimizerPlan.build(self, params)
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

"""ShardedSOAP: emerging-optimizers' SOAP, exact on Megatron-FSDP's data-parallel row shards.

SOAP's state and work are whole-matrix (``soap_matrix``): Kronecker factors ``L`` ``(m, m)`` and
``R`` ``(n, n)``, their eigenbases, the inner Adam's moments ``(m, n)``, and per step GEMMs and an
eigenbasis refresh of the whole matrix. So each matrix has one **owner** rank of its data-parallel
group (``dp_group``: ``dp_cp`` for dense params, ``expt_dp`` for experts), chosen from the shapes
alone with state bytes and FLOPs balanced (``soap_plan``; the same plan at every step). One step:

1. which params have a grad on some rank (one small all_reduce; a rank holding no rows has
   ``grad is None`` but enters every collective);
2. bucket by bucket (bucket ``k``: the ``k``-th matrix of every owner), each rank's gradient rows
   travel to the owner, which assembles the whole fp32 gradient (``exchange.OwnerExchange``, the
   exchange ``ShardedMuon`` uses); the owner runs SOAP's per-matrix work on it
   (``soap_matrix_update``: emerging-optimizers' own ``update_kronecker_factors(_kl_shampoo)``,
   ``update_eigenbasis_and_exp_avgs``, ``precondition``, ``calculate_adam_update``); each rank
   gets its rows of the update back;
3. each rank applies SOAP's weight decay (elementwise on the param: decoupled, independent or palm)
   and ``p -= lr * update`` to its own rows. Every rank counts the step.

A matrix every rank holds whole (one rank; a replicated, ``no_shard`` param) is stepped by every
rank alike, with no exchange. The arithmetic per matrix is SOAP's, on the same fp32 full matrix,
so the result is stock ``SOAP.step``'s on the full tensors up to the gradient's own reduction
order.

**State layout and checkpoints.** ``state[p]`` holds SOAP's keys (``soap_matrix.STATE_KEYS``). Where
``p`` is row-sharded, every state tensor is a DTensor on ``p``'s mesh with placement ``Shard(0)``
on its data-parallel axis and its own global shape (``(m, n)``, ``(m, m)``, ``(n, n)``), sharded
**unevenly**: the owner's local tensor is the whole tensor, every other rank's has 0 rows. Each
DTensor's chunk is known locally (``soap_state``: the owner all of it at offset 0, the others
nothing), so DCP (and
megatron_fsdp's uneven-DTensor preprocessing, whose offsets come out the same) writes each tensor
once, from its owner, under the param's name, as a plain global tensor. Loaded at another DP size,
the new plan's owner reads the whole tensor and the others read nothing: a checkpoint reloads at any
DP size, the owner of each matrix changing with it. Where every rank holds ``p`` whole, its state
tensors are laid out like ``p`` (a ``Replicate`` DTensor, a 1-rank mesh's ``Shard(0)`` or a plain
tensor), whole on every rank. ``step`` is a Python int, the same on every rank.

Refused at build time (``ValueError`` naming it): a param that is not a real 2-D matrix (as SOAP),
tensor parallelism (a tensor-parallel mesh axis), a row-sharded param with more than one
data-parallel mesh axis (HSDP), ``weight_decay_method="l2"`` (it adds the whole weight to the
gradient on the owner), CUDA ``stream_list``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from emerging_optimizers.soap.soap import SOAP
from megatron.core.optimizer.emerging_optimizers import _default_adam_based_eopt_config_to_kwargs
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import ParamsT

from megatron_muon.engine.exchange import COLLECTIVE_SCOPE, ExchangeStats, OwnerExchange
from megatron_muon.engine.layout import (
    RowLayout,
    check_same_params,
    gather_row_layouts,
    group_ranks,
    local_tensor,
    mesh_axes,
)
from megatron_muon.engine.owner_state import owner_held_dtensor, whole_dtensor
from megatron_muon.engine.step_plan import WorkBlock
from megatron_muon.optimizers.soap_matrix import (
    TENSOR_KEYS,
    SoapConfig,
    init_matrix_state,
    soap_matrix_update,
)
from megatron_muon.optimizers.soap_plan import SoapOwnerPlan, plan_soap_owners

__all__ = ["ShardedSOAP"]


class ShardedSOAP(SOAP):
    """SOAP on data-parallel row-sharded params (Megatron-FSDP), exact; owner compute.

    Args:
        params, lr, betas, shampoo_beta, eps, weight_decay: ``SOAP``'s.
        dp_group: the process group the params' rows are sharded over (``None``: the default
            group). Collective over it: construction (layouts, one all_gather) and ``step``.
        soap_kwargs: ``SOAP``'s keyword-only settings (``weight_decay_method``, ``nesterov``,
            ``use_kl_shampoo``, ``fp32_matmul_prec``, ...).

    State exists for every param on every rank from construction on (module docstring: layout).

    Raises:
        ValueError: the settings and params the module docstring lists.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        shampoo_beta: float = 0.95,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        dp_group: dist.ProcessGroup | None = None,
        **soap_kwargs: Any,
    ) -> None:
        if soap_kwargs.get("weight_decay_method", "decoupled") == "l2":
            raise ValueError(
                "ShardedSOAP: weight_decay_method='l2' adds the weight to the gradient before "
                "SOAP's whole-matrix work; use decoupled, independent or palm (elementwise on "
                "each rank's rows; megatron-core's soap is decoupled)"
            )
        if soap_kwargs.get("stream_list") is not None:
            raise ValueError("ShardedSOAP: stream_list is not supported (owner compute)")
        super().__init__(params, lr, betas, shampoo_beta, eps, weight_decay, **soap_kwargs)
        self.dp_group = dp_group
        self.num_ranks = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(dp_group) if self.num_ranks > 1 else 0
        params_list = self._all_params()
        for index, param in enumerate(params_list):
            _check_param(index, param, dp_group)
        check_same_params(params_list, dp_group)
        self.layouts: list[RowLayout] = gather_row_layouts(params_list, dp_group)
        # Matrices some rank does not hold whole get an owner; the rest are stepped everywhere.
        self.owned = [i for i, layout in enumerate(self.layouts) if not _whole_everywhere(layout)]
        self.shapes = [(layout.num_rows, layout.row_shape[0]) for layout in self.layouts]
        self.plan = plan_soap_owners([self.shapes[i] for i in self.owned], self.num_ranks)
        self.owners = {i: self.plan.owners[k] for k, i in enumerate(self.owned)}
        # The data-parallel mesh axis of each row-sharded param (its owner-held state's Shard(0)).
        self.axes = {i: _row_axis(i, params_list[i], dp_group) for i in self.owned}
        self.buckets = _owner_rounds(self.owned, self.owners)
        self._exchanges: dict[tuple[int, ...], OwnerExchange] = {}
        self.exchange_stats = ExchangeStats()
        for group in self.param_groups:
            self._init_group(group, skip_non_grad_params=False)

    @classmethod
    def from_optimizer_config(
        cls, param_groups: ParamsT, config: Any, dp_group: dist.ProcessGroup | None
    ) -> ShardedSOAP:
        """megatron-core's ``--optimizer soap`` from its ``OptimizerConfig``, on ``dp_group``.

        The keywords are those megatron-core's emerging-optimizer registry gives ``SOAP``
        (``_default_adam_based_eopt_config_to_kwargs``: ``lr``, ``weight_decay``,
        ``shampoo_beta``/``use_kl_shampoo`` from ``soap_*``, ``betas`` from ``adam_beta1/2``).

        Raises:
            ValueError: a ``soap_*`` value ``SoapConfig`` refuses (naming the field).
        """
        SoapConfig.from_optimizer_config(config)
        kwargs = _default_adam_based_eopt_config_to_kwargs("soap", config, None, None)
        return cls(param_groups, dp_group=dp_group, **kwargs)

    def owner_plan(self) -> SoapOwnerPlan:
        """The owner of each row-sharded matrix (in param order) and each rank's loads."""
        return self.plan

    def local_state_bytes(self) -> int:
        """Bytes of SOAP state this rank holds: its owned matrices' (``owner_plan().state_bytes``
        of this rank) and those of the matrices every rank holds whole."""
        tensors = [local_tensor(v) for s in self.state.values() for v in s.values()]
        return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def _init_group(self, group: dict, skip_non_grad_params: bool = True) -> None:
        """Creates every param's missing state (module docstring: layout), grad or not: state is
        rank-symmetric, so checkpoint keys are the same on every rank. Local, no collective."""
        index = {id(p): i for i, p in enumerate(self._all_params())}
        for param in group["params"]:
            state = self.state[param]
            if state:
                continue
            i = index[id(param)]
            shape = self.shapes[i]
            owner = self.owners.get(i)
            whole = owner is None or owner == self.rank
            device = local_tensor(param).device
            values = init_matrix_state(shape if whole else (0, shape[1]), device)
            if not whole:  # each tensor's empty rows: (0, cols) of its own global shape
                values.update(
                    L=values["L"].new_zeros(0, shape[0]),
                    Q_L=values["Q_L"].new_zeros(0, shape[0]),
                    R=values["R"].new_zeros(0, shape[1]),
                    Q_R=values["Q_R"].new_zeros(0, shape[1]),
                )
            global_shapes = _global_shapes(shape)
            for key in TENSOR_KEYS:
                if owner is not None:
                    values[key] = owner_held_dtensor(
                        values[key], param, self.axes[i], global_shapes[key], owner == self.rank
                    )
                elif isinstance(param, DTensor):
                    values[key] = whole_dtensor(values[key], param)
            state.update(values)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """One SOAP step. Collective over ``dp_group``: every rank must call it."""
        if closure is not None:
            raise ValueError("closure is not supported")
        for group in self.param_groups:
            self._init_group(group, skip_non_grad_params=False)
        params = self._all_params()
        groups = [g for g in self.param_groups for _ in g["params"]]
        active = self._with_grad_anywhere(params)
        owned = set(self.owned)
        for i, param in enumerate(params):
            if active[i] and i not in owned:  # whole on every rank: stepped here
                grad = self._grad_rows(param, self.layouts[i])
                self._apply(param, groups[i], self._update(i, param, grad, groups[i]))
        for bucket in self.buckets:
            bucket = tuple(i for i in bucket if active[i])
            if bucket:
                self._step_bucket(bucket, params, groups)
        for i, param in enumerate(params):
            if active[i]:
                self.state[param]["step"] += 1

    def _step_bucket(self, bucket: tuple[int, ...], params: list, groups: list) -> None:
        """Gradient rows to the owners, SOAP's work there, update rows back and applied."""
        exchange = self._exchanges.get(bucket)
        if exchange is None:
            exchange = OwnerExchange(
                [self.layouts[i] for i in bucket],
                [[WorkBlock.whole(self.owners[i], self.layouts[i])] for i in bucket],
                list(bucket),
                self.rank,
                self.dp_group,
                local_tensor(params[bucket[0]]).device,
            )
            self._exchanges[bucket] = exchange
        rows = [self._grad_rows(params[i], self.layouts[i]) for i in bucket]
        stats = self.exchange_stats
        full = exchange.finish(exchange.start_gather_to_owners(rows, stats))
        results = {}
        for key in sorted(full):
            i = bucket[key[0]]
            grad = full.pop(key)
            results[key] = self._update(i, params[i], grad, groups[i])
            del grad
        mine = exchange.finish(exchange.start_scatter_from_owners(results, stats))
        del results
        for m, i in enumerate(bucket):
            self._apply(params[i], groups[i], mine[m])

    def _grad_rows(self, param: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        """This rank's gradient rows, fp32 (zeros where it has none: 0 rows, or no grad)."""
        if param.grad is not None:
            return local_tensor(param.grad).to(torch.float32)
        rows = layout.rows_of(self.rank)
        return torch.zeros(rows, *layout.row_shape, device=local_tensor(param).device)

    def _update(self, i: int, param: torch.Tensor, grad: torch.Tensor, group: dict) -> torch.Tensor:
        """``soap_matrix_update`` on the param's whole state, here (its owner, or every rank),
        which then holds the new moments and eigenbases as ``SOAP.step`` leaves them."""
        state = self.state[param]
        local = {key: local_tensor(value) for key, value in state.items()}
        update = soap_matrix_update(self, local, grad, group)
        shapes = _global_shapes(self.shapes[i])
        for key in TENSOR_KEYS:
            if local[key] is local_tensor(state[key]):
                continue
            if i in self.owners:
                state[key] = owner_held_dtensor(local[key], param, self.axes[i], shapes[key], True)
            elif isinstance(param, DTensor):
                state[key] = whole_dtensor(local[key], param)
            else:
                state[key] = local[key]
        return update

    def _apply(self, param: torch.Tensor, group: dict, update: torch.Tensor) -> None:
        """SOAP's weight decay and ``p -= lr * update`` on this rank's rows (``update``: them)."""
        rows = local_tensor(param)
        if rows.numel() == 0:
            return
        grad = local_tensor(param.grad) if param.grad is not None else torch.zeros_like(rows)
        self._apply_weight_decay_inplace(rows, grad, group["lr"], group["weight_decay"])
        rows.add_(update.view_as(rows).to(rows.dtype), alpha=-group["lr"])

    def _with_grad_anywhere(self, params: list[torch.Tensor]) -> list[bool]:
        """Which params have a grad on some rank of ``dp_group`` (one small all_reduce)."""
        flags = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        if self.num_ranks > 1:
            with torch.profiler.record_function(COLLECTIVE_SCOPE):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.dp_group)
        return [bool(f) for f in flags.tolist()]


def _whole_everywhere(layout: RowLayout) -> bool:
    return all(interval == (0, layout.num_rows) for interval in layout.ranges)


def _global_shapes(shape: tuple[int, int]) -> dict[str, tuple[int, int]]:
    m, n = shape
    return {
        "exp_avg": (m, n),
        "exp_avg_sq": (m, n),
        "L": (m, m),
        "Q_L": (m, m),
        "R": (n, n),
        "Q_R": (n, n),
    }


def _owner_rounds(owned: list[int], owners: dict[int, int]) -> list[tuple[int, ...]]:
    """Buckets: the ``k``-th matrix (param order) of every owner, for ``k = 0, 1, ...``; one
    whole gradient and one update per rank alive at a time, every rank busy in every bucket."""
    per_owner: dict[int, list[int]] = {}
    for i in owned:
        per_owner.setdefault(owners[i], []).append(i)
    rounds = max((len(v) for v in per_owner.values()), default=0)
    return [tuple(sorted(v[k] for v in per_owner.values() if k < len(v))) for k in range(rounds)]


def _check_param(index: int, param: torch.Tensor, dp_group: dist.ProcessGroup | None) -> None:
    where = f"ShardedSOAP: param {index} of shape {tuple(param.shape)}"
    if param.ndim != 2 or param.is_complex():
        raise ValueError(f"{where}: SOAP steps real 2-D matrices; route it to the scalar optimizer")
    if isinstance(param, DTensor) and mesh_axes(param, group_ranks(dp_group)).tensor_parallel:
        raise ValueError(
            f"{where} is split by tensor parallelism: soap on Megatron-FSDP runs at TP=1 (the "
            "reference is SOAP on the whole matrix)"
        )


def _row_axis(index: int, param: torch.Tensor, dp_group: dist.ProcessGroup | None) -> int:
    """The one mesh axis ``param``'s rows are sharded over (``Shard(0)``, ``dp_group``)."""
    axes = mesh_axes(param, group_ranks(dp_group)) if isinstance(param, DTensor) else None
    if axes is None or len(axes.data_parallel) != 1:
        placements = param.placements if isinstance(param, DTensor) else "plain tensor"
        raise ValueError(
            f"ShardedSOAP: param {index} of shape {tuple(param.shape)} is row-sharded with "
            f"placements {placements}; ShardedSOAP keeps owner state on one data-parallel mesh "
            "axis with Shard(0) (HSDP is not supported)"
        )
    return axes.data_parallel[0]

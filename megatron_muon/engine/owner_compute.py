"""Owner compute: an optimizer whose per-matrix state and work need the whole matrix, exact on
Megatron-FSDP's data-parallel row shards.

``OwnerComputedOptimizer`` is the engine's part of such an optimizer (SOAP, REKLS, PSGDPro: their
adapters in ``megatron_muon.optimizers`` say only what their state is and what one matrix's work
is). Each matrix has one **owner** rank of its data-parallel group (``dp_group``: ``dp_cp`` for
dense params, ``expt_dp`` for experts), chosen from the shapes alone with the optimizer's state
bytes and FLOPs balanced (``state_owners``; the same plan at every step). One step:

1. which params have a grad on some rank, and any values the ranks must agree on (the
   adapter's ``_values_to_agree``), in one small all_reduce (a rank holding no rows has
   ``grad is None`` but enters every collective);
2. bucket by bucket (bucket ``k``: the ``k``-th matrix of every owner), each rank's gradient rows
   travel to the owner, which assembles the whole fp32 gradient (``exchange.OwnerExchange``); the
   owner runs the adapter's ``_matrix_update`` on it and its whole state; each rank gets its rows
   of the update back;
3. each rank applies the optimizer's weight decay (elementwise on the param: decoupled,
   independent or palm; ``_apply_weight_decay_inplace`` of emerging-optimizers' mixin) and
   ``p -= lr * update`` to its own rows. Every rank counts the step (where the optimizer does).

A matrix every rank holds whole (one rank; a replicated, ``no_shard`` param) is stepped by every
rank alike, with no exchange.

**State layout and checkpoints.** ``state[p]`` holds the adapter's keys (``STATE_KEYS``; the
tensors as its ``init_matrix_state`` makes them). Where ``p`` is row-sharded, every state tensor is
an owner-held DTensor (``owner_state``): the whole tensor on the owner, 0 rows elsewhere, so a
checkpoint saved at one DP size loads at another, each matrix's owner changing with it. Where
every rank holds ``p`` whole, its state tensors are laid out like ``p``, whole on every rank.

Refused at build time (``ValueError`` naming it): ``weight_decay_method="l2"`` (it adds the whole
weight to the gradient before the owner's work), a param that is not a real 2-D matrix, tensor
parallelism (a tensor-parallel mesh axis), a row-sharded param with more than one data-parallel
mesh axis (HSDP).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from emerging_optimizers import registry
from torch.distributed.tensor import DTensor

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
from megatron_muon.engine.state_owners import StateOwnerPlan, plan_state_owners
from megatron_muon.engine.step_plan import WorkBlock

__all__ = ["OwnerComputedOptimizer"]


class OwnerComputedOptimizer(torch.optim.Optimizer):
    """The owner machinery (module docstring), mixed in before the optimizer's own class.

    An adapter ``class ShardedX(OwnerComputedOptimizer, X)`` sets the class attributes, defines
    ``init_matrix_state`` and ``_matrix_update``, and calls ``_setup_owners(dp_group)`` at the end
    of its constructor (after ``X.__init__``).

    Attributes:
        STATE_KEYS: the per-matrix state keys (the tensors and, e.g., ``step``).
        name: emerging-optimizers' registry name (errors, ``--optimizer``).
        counts_steps: whether ``state["step"]`` counts the steps (the class's own rule).
    """

    STATE_KEYS: ClassVar[tuple[str, ...]]
    name: ClassVar[str]
    counts_steps: ClassVar[bool] = True

    if TYPE_CHECKING:  # emerging_optimizers.mixin.WeightDecayMixin's, on the optimizer's class

        def _apply_weight_decay_inplace(
            self, p: torch.Tensor, grad: torch.Tensor, lr: float, weight_decay: float
        ) -> None: ...

    @classmethod
    def from_optimizer_config(
        cls, param_groups: Any, config: Any, dp_group: dist.ProcessGroup | None
    ) -> OwnerComputedOptimizer:
        """One built from megatron-core's ``OptimizerConfig`` (the factory's door), on
        ``dp_group``."""
        raise NotImplementedError

    @classmethod
    def reference_name(cls) -> str:
        """The optimizer's own class name (``SOAP``, ``PSGDPro``): summaries, errors."""
        return registry.get_optimizer_cls(cls.name).__name__

    @staticmethod
    def state_bytes(shape: tuple[int, int]) -> int:
        """The planner's state bytes of one ``(m, n)`` matrix (``state_owners.MatrixCostFn``)."""
        raise NotImplementedError

    @staticmethod
    def flops(shape: tuple[int, int]) -> int:
        """The planner's FLOPs per step of one ``(m, n)`` matrix."""
        raise NotImplementedError

    def init_matrix_state(self, shape: tuple[int, int], device: torch.device) -> dict[str, Any]:
        """One whole ``(m, n)`` matrix's initial state, as the optimizer's first step makes it."""
        raise NotImplementedError

    def _matrix_update(
        self, index: int, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        """Matrix ``index``'s whole update ``(m, n)`` (the param then moves by ``-lr`` times it)
        from its whole fp32 gradient; ``state``: its whole state (plain tensors), updated in place
        or rebound; ``step`` not touched (counted on every rank)."""
        raise NotImplementedError

    def _values_to_agree(self) -> list[int]:
        """Non-negative int32 values every rank of ``dp_group`` must use alike this step (their
        maximum, from step 1's all_reduce, goes to ``_prepare_step``)."""
        return []

    def _prepare_step(self, agreed: list[int]) -> None:
        """Called at each step with the agreed ``_values_to_agree``, before any update."""

    def _setup_owners(self, dp_group: dist.ProcessGroup | None) -> None:
        """Layouts, owner plan and buckets; every param's state. Collective over ``dp_group``."""
        if getattr(self, "weight_decay_method", None) == "l2":
            reference = self.reference_name()
            raise ValueError(
                f"{type(self).__name__}: weight_decay_method='l2' adds the weight to the gradient "
                f"before {reference}'s whole-matrix work; use decoupled, independent or palm "
                "(elementwise on each rank's rows; megatron-core's default is decoupled)"
            )
        self.dp_group = dp_group
        self.num_ranks = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(dp_group) if self.num_ranks > 1 else 0
        params_list = self._all_params()
        for index, param in enumerate(params_list):
            self._check_param(index, param, dp_group)
        check_same_params(params_list, dp_group)
        self.layouts: list[RowLayout] = gather_row_layouts(params_list, dp_group)
        # Matrices some rank does not hold whole get an owner; the rest are stepped everywhere.
        self.owned = [i for i, layout in enumerate(self.layouts) if not _whole_everywhere(layout)]
        self.shapes = [(layout.num_rows, layout.row_shape[0]) for layout in self.layouts]
        owned_shapes = [self.shapes[i] for i in self.owned]
        cls = type(self)
        self.plan = plan_state_owners(
            owned_shapes, self.num_ranks, cls.state_bytes, cls.flops, cls.__name__
        )
        self.owners = {i: self.plan.owners[k] for k, i in enumerate(self.owned)}
        # The data-parallel mesh axis of each row-sharded param (its owner-held state's Shard(0)).
        self.axes = {i: self._row_axis(i, params_list[i], dp_group) for i in self.owned}
        self.buckets = _owner_rounds(self.owned, self.owners)
        self._exchanges: dict[tuple[int, ...], OwnerExchange] = {}
        self.exchange_stats = ExchangeStats()
        for group in self.param_groups:
            self._init_group(group, skip_non_grad_params=False)

    def owner_plan(self) -> StateOwnerPlan:
        """The owner of each row-sharded matrix (in param order) and each rank's loads."""
        return self.plan

    def local_state_bytes(self) -> int:
        """Bytes of state this rank holds: its owned matrices' (``owner_plan().state_bytes`` of
        this rank) and those of the matrices every rank holds whole."""
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
            owner = self.owners.get(i)
            device = local_tensor(param).device
            # Each tensor's global shape, from a meta copy of the whole state (no memory).
            meta = self.init_matrix_state(self.shapes[i], torch.device("meta"))
            shapes = {key: tuple(v.shape) for key, v in meta.items() if torch.is_tensor(v)}
            if owner is None or owner == self.rank:
                values = self.init_matrix_state(self.shapes[i], device)
            else:  # each tensor's empty rows: (0, cols) of its own global shape
                values = {
                    key: torch.zeros((0, *v.shape[1:]), dtype=v.dtype, device=device)
                    if torch.is_tensor(v)
                    else v
                    for key, v in meta.items()
                }
            state.update(self._wrapped(i, param, values, shapes))

    def _wrapped(
        self, i: int, param: torch.Tensor, values: dict, shapes: dict[str, tuple[int, ...]]
    ) -> dict:
        """``values``' tensors laid out as the param's state (module docstring), ``shapes`` their
        global shapes: owner-held where some rank lacks rows, like ``param`` where every rank
        holds it whole, else plain."""
        out = {}
        for key, value in values.items():
            if not torch.is_tensor(value):
                out[key] = value
            elif i in self.owners:
                is_owner = self.owners[i] == self.rank
                out[key] = owner_held_dtensor(value, param, self.axes[i], shapes[key], is_owner)
            elif isinstance(param, DTensor):
                out[key] = whole_dtensor(value, param)
            else:
                out[key] = value
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]  # no closure: refused
        """One step. Collective over ``dp_group``: every rank must call it."""
        if closure is not None:
            raise ValueError("closure is not supported")
        for group in self.param_groups:
            self._init_group(group, skip_non_grad_params=False)
        params = self._all_params()
        groups = [g for g in self.param_groups for _ in g["params"]]
        active, agreed = self._with_grad_anywhere(params, self._values_to_agree())
        self._prepare_step(agreed)
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
            if active[i] and self.counts_steps:
                self.state[param]["step"] += 1

    def _step_bucket(self, bucket: tuple[int, ...], params: list, groups: list) -> None:
        """Gradient rows to the owners, the matrix work there, update rows back and applied."""
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
        """``_matrix_update`` on the param's whole state, here (its owner, or every rank), which
        then holds the new state as the optimizer's own step leaves it."""
        state = self.state[param]
        local = {key: local_tensor(value) for key, value in state.items()}
        update = self._matrix_update(i, local, grad, group)
        changed = {
            key: value
            for key, value in local.items()
            if torch.is_tensor(value) and value is not local_tensor(state[key])
        }
        shapes = {key: tuple(value.shape) for key, value in changed.items()}  # whole here
        state.update(self._wrapped(i, param, changed, shapes))
        return update

    def _apply(self, param: torch.Tensor, group: dict, update: torch.Tensor) -> None:
        """Weight decay and ``p -= lr * update`` on this rank's rows (``update``: them)."""
        rows = local_tensor(param)
        if rows.numel() == 0:
            return
        grad = local_tensor(param.grad) if param.grad is not None else torch.zeros_like(rows)
        self._apply_weight_decay_inplace(rows, grad, group["lr"], group["weight_decay"])
        rows.add_(update.view_as(rows).to(rows.dtype), alpha=-group["lr"])

    def _with_grad_anywhere(
        self, params: list[torch.Tensor], values: list[int]
    ) -> tuple[list[bool], list[int]]:
        """Which params have a grad on some rank of ``dp_group``, and the maximum of ``values``
        over the ranks (one small all_reduce)."""
        flags = torch.tensor([p.grad is not None for p in params] + values, dtype=torch.int32)
        if self.num_ranks > 1:
            with torch.profiler.record_function(COLLECTIVE_SCOPE):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.dp_group)
        reduced = flags.tolist()
        return [bool(f) for f in reduced[: len(params)]], reduced[len(params) :]

    def _check_param(
        self, index: int, param: torch.Tensor, dp_group: dist.ProcessGroup | None
    ) -> None:
        where = f"{type(self).__name__}: param {index} of shape {tuple(param.shape)}"
        reference = self.reference_name()  # SOAP, PSGDPro, ...
        if param.ndim != 2 or param.is_complex():
            raise ValueError(
                f"{where}: {reference} steps real 2-D matrices; route it to the scalar optimizer"
            )
        if isinstance(param, DTensor) and mesh_axes(param, group_ranks(dp_group)).tensor_parallel:
            raise ValueError(
                f"{where} is split by tensor parallelism: {self.name} on Megatron-FSDP runs at "
                f"TP=1 (the reference is {reference} on the whole matrix)"
            )

    def _row_axis(self, index: int, param: torch.Tensor, dp_group: dist.ProcessGroup | None) -> int:
        """The one mesh axis ``param``'s rows are sharded over (``Shard(0)``, ``dp_group``)."""
        axes = mesh_axes(param, group_ranks(dp_group)) if isinstance(param, DTensor) else None
        if axes is None or len(axes.data_parallel) != 1:
            placements = param.placements if isinstance(param, DTensor) else "plain tensor"
            raise ValueError(
                f"{type(self).__name__}: param {index} of shape {tuple(param.shape)} is "
                f"row-sharded with placements {placements}; it keeps owner state on one "
                "data-parallel mesh axis with Shard(0) (HSDP is not supported)"
            )
        return axes.data_parallel[0]


def _whole_everywhere(layout: RowLayout) -> bool:
    return all(interval == (0, layout.num_rows) for interval in layout.ranges)


def _owner_rounds(owned: list[int], owners: dict[int, int]) -> list[tuple[int, ...]]:
    """Buckets: the ``k``-th matrix (param order) of every owner, for ``k = 0, 1, ...``; one
    whole gradient and one update per rank alive at a time, every rank busy in every bucket."""
    per_owner: dict[int, list[int]] = {}
    for i in owned:
        per_owner.setdefault(owners[i], []).append(i)
    rounds = max((len(v) for v in per_owner.values()), default=0)
    return [tuple(sorted(v[k] for v in per_owner.values() if k < len(v))) for k in range(rounds)]

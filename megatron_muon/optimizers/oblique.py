"""ShardedObliqueSGD, ShardedObliqueAdam: emerging-optimizers' oblique-manifold optimizers on
Megatron-FSDP's data-parallel row shards.

``ObliqueSGD`` and ``ObliqueAdam`` keep each row (``dim=1``) or each column (``dim=0``, their
default) of a 2-D param at unit norm. A step: the momentum (SGD: ``buf = grad + momentum * buf``)
or Adam's moments and their ratio (``adam_direction``), all elementwise; the Riemannian gradient
``g - p * <p, g>`` with the inner products over ``dim``; weight decay; ``p -= lr * g_riem``; the
retraction ``p / max(||p||, eps)`` with the norms over ``dim``.

On row shards (DTensor ``Shard(0)``, uneven or empty, over ``dp_group``: ``dp_cp``, or ``expt_dp``
for experts), the elementwise parts run on each rank's local rows. Over ``dim=1`` each row is
local, so the inner products and norms are too: the class's own functions
(``_compute_riemannian_grad``, ``torch.nn.functional.normalize``) on the local rows, the same
arithmetic as on the full matrix. Over ``dim=0`` each column spans every rank's rows: each rank sums
its rows (``column_partial_sums``: fp32, zeros where it holds none or holds replicated rows another
rank counts), one ``all_reduce`` over ``dp_group`` per param group sums the partial sums of all
its params, and the same formulas then use the column sums. Every rank enters these collectives,
also with no rows of a param or ``grad is None``. The sums round in another order than one sum
over the whole column: fp32 reduction order is the only difference from the class.

State (``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``) is the class's, created at build
time for every param on every rank (rank-symmetric keys, which DCP needs); ObliqueAdam's ``step``
is a Python int counted by every rank alike (a rank without rows counts a step it has no grad
for).

Refused at build time (``ValueError``): a param that is not 2-D (as the classes), tensor
parallelism (a TP block's rows or columns are not whole), a ``dim`` other than 0 or 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from emerging_optimizers.mixin import WeightDecayT
from emerging_optimizers.riemannian_optimizers.normalized_optimizer import (
    ObliqueAdam,
    ObliqueSGD,
    _compute_riemannian_grad,
)
from megatron.core.optimizer.emerging_optimizers import (
    _default_adam_based_eopt_config_to_kwargs,
    _kwargs_from_config,
)
from torch.optim.optimizer import ParamsT

from megatron_muon.engine.layout import check_same_params, gather_row_layouts, local_tensor
from megatron_muon.engine.tensor_parallel import tp_group
from megatron_muon.optimizers.settings import as_keywords, read_settings

__all__ = [
    "ObliqueAdamConfig",
    "ObliqueSGDConfig",
    "ShardedObliqueAdam",
    "ShardedObliqueSGD",
    "adam_direction",
    "column_partial_sums",
]


def _help(name: str, text: str) -> dict[str, str]:
    """A field's flag help (``fsdp.arguments.add_optimizer_config_flags`` reads it)."""
    return {"help": f"--optimizer {name}: {text}."}


def _dim_field(name: str) -> Any:
    return field(default=0, metadata=_help(name, "normalize columns (0, the default) or rows (1)"))


def _eps_field(name: str) -> Any:
    return field(default=1e-8, metadata=_help(name, "lower bound of a norm in the retraction"))


def _decay_field(name: str) -> Any:
    return field(
        default="decoupled", metadata=_help(name, "how weight decay applies (emerging-optimizers')")
    )


def _check(dim: Any, eps: float) -> None:
    if dim not in (0, 1):
        raise ValueError(f"dim must be 0 (columns) or 1 (rows), got {dim!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ObliqueSGDConfig:
    """ObliqueSGD's settings beyond ``OptimizerConfig``'s fields
    (``OptimizerConfig.oblique_sgd_<field>`` where set, flags ``--oblique-sgd-<field>``; defaults
    the class's). Its ``momentum`` is Megatron's ``sgd_momentum`` (``--sgd-momentum``) unless
    ``oblique_sgd_momentum`` is set."""

    dim: int = _dim_field("oblique_sgd")
    eps: float = _eps_field("oblique_sgd")
    weight_decay_method: WeightDecayT = _decay_field("oblique_sgd")

    prefix: ClassVar[str] = "oblique_sgd"

    def __post_init__(self) -> None:
        _check(self.dim, self.eps)


@dataclass(frozen=True, kw_only=True, slots=True)
class ObliqueAdamConfig:
    """ObliqueAdam's settings beyond ``OptimizerConfig``'s fields
    (``OptimizerConfig.oblique_adam_<field>`` where set, flags ``--oblique-adam-<field>``;
    defaults the class's). Its ``betas`` are ``adam_beta1``/``adam_beta2``, as megatron-core's
    default emerging-optimizer entry gives them."""

    dim: int = _dim_field("oblique_adam")
    eps: float = _eps_field("oblique_adam")
    correct_bias: bool = field(
        default=True, metadata=_help("oblique_adam", "bias corrections of the two moments' EMAs")
    )
    weight_decay_method: WeightDecayT = _decay_field("oblique_adam")

    prefix: ClassVar[str] = "oblique_adam"

    def __post_init__(self) -> None:
        _check(self.dim, self.eps)


# --------------------------------------------------------------------------------------------------
# the math on local rows
# --------------------------------------------------------------------------------------------------


def column_partial_sums(tensors: list[torch.Tensor], counted: list[bool]) -> list[torch.Tensor]:
    """Each local ``(rows, cols)`` tensor's column sums ``(1, cols)``, or zeros where this rank's
    rows are not ``counted`` (none, or replicated rows another rank counts)."""
    return [
        t.sum(dim=0, keepdim=True) if count else t.new_zeros(1, t.shape[1])
        for t, count in zip(tensors, counted, strict=True)
    ]


def adam_direction(
    grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
) -> torch.Tensor:
    """ObliqueAdam's moment updates (in place, local tensors) and the direction it projects:
    ``(m / bc1) / (sqrt(v) / bc2 + eps)``, ``ObliqueAdam.step``'s formulas."""
    beta1, beta2 = group["betas"]
    exp_avg, exp_avg_sq = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = state["step"]
    corrections = (1.0 - beta1**step, 1.0 - beta2**step) if group["correct_bias"] else (1.0, 1.0)
    return (exp_avg / corrections[0]) / (exp_avg_sq.sqrt() / corrections[1] + group["eps"])


class _RowSharded:
    """What both sharded classes add to their class: the row group, which rows this rank counts
    in a column sum, and the step on local rows around the class's direction (``_direction``)."""

    param_groups: list[dict[str, Any]]
    state: Any
    _apply_weight_decay_inplace: Callable[..., None]
    #: The state every param holds (``checkpointing.optimizer_state``).
    state_keys: ClassVar[tuple[str, ...]]
    label: ClassVar[str]

    def __init__(
        self,
        params: ParamsT,
        *,
        dp_group: dist.ProcessGroup | None = None,
        pg_collection: Any = None,
        **kwargs: Any,
    ) -> None:
        """The class's constructor (``kwargs``), then ``_shard``."""
        super().__init__(params, **kwargs)  # type: ignore[call-arg]  # the class's, next in the MRO
        self._shard(dp_group, pg_collection)

    def _shard(self, dp_group: dist.ProcessGroup | None, pg_collection: Any) -> None:
        """Checks the params, finds this rank's counted rows (collective over ``dp_group``) and
        creates every param's state."""
        self.dp_group = dp_group
        for group in self.param_groups:
            try:
                _check(group["dim"], group["eps"])
            except ValueError as error:
                raise ValueError(f"{self.label}: {error}") from None
        params = [p for group in self.param_groups for p in group["params"]]
        for index, param in enumerate(params):
            if param.ndim != 2:
                raise ValueError(
                    f"{self.label}: param {index} of shape {tuple(param.shape)} is not 2-D; "
                    f"{self.label} normalizes rows or columns of matrices"
                )
            tp = tp_group(param, pg_collection)
            if tp is not None and dist.get_world_size(tp) > 1:
                raise ValueError(
                    f"{self.label} runs at tensor-parallel size 1 only, got size "
                    f"{dist.get_world_size(tp)}: a TP block's rows or columns are not whole"
                )
        self.num_ranks = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        rank = dist.get_rank(dp_group) if dist.is_initialized() else 0
        check_same_params(params, dp_group)
        self._counted = {
            id(param): any(
                holders[0] == rank for _, holders in layout.intervals() if rank in holders
            )
            for param, layout in zip(params, gather_row_layouts(params, dp_group), strict=True)
        }
        for group in self.param_groups:
            self._init_group(group)

    def _init_group(self, group: dict[str, Any], skip_non_grad_params: bool = False) -> None:
        """The class's state for every param of ``group`` (zeros like the param; step 0)."""
        for param in group["params"]:
            if skip_non_grad_params and param.grad is None:
                continue
            state = self.state[param]
            for key in self.state_keys:
                if key not in state:
                    state[key] = 0 if key == "step" else torch.zeros_like(param)

    def _direction(
        self, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """The class's step on each param's local rows (module docstring). Collective over
        ``dp_group`` for a group with ``dim=0``."""
        if closure is not None:
            raise ValueError("closure is not supported")
        for group in self.param_groups:
            self._step_group(group)

    def _step_group(self, group: dict[str, Any]) -> None:
        lr, dim, eps = group["lr"], group["dim"], group["eps"]
        rows, directions, stepped = [], [], []
        for param in group["params"]:
            local = local_tensor(param)
            grad = None if param.grad is None else local_tensor(param.grad)
            state = self.state[param]
            if "step" in state and (grad is not None or local.numel() == 0):
                state["step"] += 1  # a rank without rows (grad None) counts it too
            rows.append(local)
            stepped.append(grad is not None and local.numel() > 0)
            if grad is not None and stepped[-1]:
                directions.append(self._direction(grad, state, group))
            else:  # nothing to update here; the rank still enters the column sums
                directions.append(torch.zeros_like(local))
        counted = [
            self._counted[id(p)] and s for p, s in zip(group["params"], stepped, strict=True)
        ]
        riemannian = self._riemannian_grads(rows, directions, counted, dim)
        for local, riem, active in zip(rows, riemannian, stepped, strict=True):
            if active:
                self._apply_weight_decay_inplace(local, riem, lr, group["weight_decay"])
                local.add_(riem, alpha=-lr)
        self._retract(rows, counted, dim, eps)

    def _riemannian_grads(
        self,
        rows: list[torch.Tensor],
        directions: list[torch.Tensor],
        counted: list[bool],
        dim: int,
    ) -> list[torch.Tensor]:
        """``d - p * <p, d>`` per param, the inner products over ``dim`` (``dim=0``: summed over
        ``dp_group``)."""
        if dim == 1:
            return [
                _compute_riemannian_grad(p, d, 1) for p, d in zip(rows, directions, strict=True)
            ]
        products = [p * d for p, d in zip(rows, directions, strict=True)]
        inner = self._column_sums(products, counted)
        return [
            torch.add(d, p * i, alpha=-1) for p, d, i in zip(rows, directions, inner, strict=True)
        ]

    def _retract(self, rows: list[torch.Tensor], counted: list[bool], dim: int, eps: float) -> None:
        """Each param's rows (``dim=1``) or columns (``dim=0``, norms summed over ``dp_group``)
        back to unit norm, in place: ``torch.nn.functional.normalize``'s formula."""
        if dim == 1:
            for local in rows:
                torch.nn.functional.normalize(local, p=2.0, dim=1, eps=eps, out=local)
            return
        squares = self._column_sums([local.square() for local in rows], counted)
        for local, square in zip(rows, squares, strict=True):
            torch.div(local, square.sqrt().clamp_min(eps).expand_as(local), out=local)

    def _column_sums(self, tensors: list[torch.Tensor], counted: list[bool]) -> list[torch.Tensor]:
        """Each ``(rows, cols)`` local tensor's whole-column sums ``(1, cols)``: this rank's
        ``column_partial_sums`` summed over ``dp_group`` in one all_reduce (every rank enters)."""
        partial = column_partial_sums(tensors, counted)
        if self.num_ranks == 1 or not partial:
            return partial
        flat = torch.cat([p.flatten() for p in partial])
        dist.all_reduce(flat, group=self.dp_group)
        return [s.view(1, -1) for s in flat.split([p.shape[1] for p in partial])]


class ShardedObliqueSGD(_RowSharded, ObliqueSGD):
    """``ObliqueSGD`` on row shards (module docstring). Construction is collective over
    ``dp_group``.

    Args:
        params: 2-D params or param groups (row-sharded DTensors, replicated or plain tensors).
        dp_group: the group the rows are sharded over (None: the world).
        pg_collection: its ``tp``/``expt_tp`` must have one rank (None: no TP).
        **kwargs: ``ObliqueSGD``'s keywords (checked by it).
    """

    state_keys = ("momentum_buffer",)
    label = "ObliqueSGD"

    @classmethod
    def from_optimizer_config(
        cls, params: ParamsT, config: Any, **kwargs: Any
    ) -> ShardedObliqueSGD:
        """``lr``, ``weight_decay``, ``momentum`` (``oblique_sgd_momentum``, else
        ``sgd_momentum``) and ``ObliqueSGDConfig``'s from ``config``; ``kwargs``: ``dp_group``,
        ``pg_collection``. megatron-core 0.19.2's default entry adds Adam's ``betas``, which
        ObliqueSGD does not take (its build raises ``TypeError``): not added here."""
        keywords = _kwargs_from_config(ObliqueSGD, "oblique_sgd", config)
        keywords.setdefault("momentum", config.sgd_momentum)
        keywords.update(as_keywords(read_settings(ObliqueSGDConfig, config)))
        return cls(params, **kwargs, **keywords)

    def _direction(
        self, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> torch.Tensor:
        """ObliqueSGD's momentum (``buf = grad + momentum * buf``, in place) is the direction."""
        buf = local_tensor(state["momentum_buffer"])
        torch.add(grad, buf, alpha=group["momentum"], out=buf)
        return buf


class ShardedObliqueAdam(_RowSharded, ObliqueAdam):
    """``ObliqueAdam`` on row shards (module docstring); arguments as ``ShardedObliqueSGD``'s,
    ``**kwargs`` ``ObliqueAdam``'s. Construction is collective over ``dp_group``."""

    state_keys = ("step", "exp_avg", "exp_avg_sq")
    label = "ObliqueAdam"

    @classmethod
    def from_optimizer_config(
        cls, params: ParamsT, config: Any, **kwargs: Any
    ) -> ShardedObliqueAdam:
        """megatron-core's keywords for ``--optimizer oblique_adam`` (its default entry: ``lr``,
        ``weight_decay``, ``betas`` from ``adam_beta1/2``) and ``ObliqueAdamConfig``'s;
        ``kwargs``: ``dp_group``, ``pg_collection``."""
        keywords = _default_adam_based_eopt_config_to_kwargs("oblique_adam", config, None, None)
        keywords.update(as_keywords(read_settings(ObliqueAdamConfig, config)))
        return cls(params, **kwargs, **keywords)

    def _direction(
        self, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> torch.Tensor:
        return adam_direction(grad, state, group)

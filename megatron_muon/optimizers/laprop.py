"""ShardedLaProp: emerging-optimizers' LaProp on Megatron-FSDP's data-parallel row shards.

LaProp's update (``calculate_laprop_update``: the second-moment EMA, the gradient divided by its
root, the first-moment EMA of that, the bias corrections) and its weight decay are elementwise, so
each rank steps its own rows of each param (DTensor ``Shard(0)``, uneven or empty, or a whole
replicated param) with the class's own functions on plain local tensors (``local_tensor``): the
same arithmetic per element as ``LaProp.step`` on the full tensor. ``calculate_laprop_update`` is
``torch.compile``'d; called on the DTensor its guards would see the global shape while the kernel
runs on the local rows (what broke Lion: ``fsdp.elementwise_optimizers``), so it gets the local
tensors.

State (``step``, ``exp_avg``, ``exp_avg_sq``, as ``LaProp._init_group``) is created at build time
for every param on every rank, a rank holding no rows of a param included (it has ``grad is None``
there; rank-symmetric state keys, which DCP needs). ``step`` is a Python int counted by every rank
alike: a rank without rows counts the step of a param it has no grad for, as the ranks holding
rows do.

Refused at build time (``ValueError``): ``frob_normalize=True`` (it rescales each param to its
pre-update Frobenius norm, a sum over every rank's rows, which this elementwise step does not
take).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from emerging_optimizers.mixin import WeightDecayT
from emerging_optimizers.scalar_optimizers import LaProp
from emerging_optimizers.scalar_optimizers.update_functions import calculate_laprop_update
from megatron.core.optimizer.emerging_optimizers import _default_adam_based_eopt_config_to_kwargs
from torch.optim.optimizer import ParamsT

from megatron_muon.engine.layout import local_tensor
from megatron_muon.optimizers.settings import as_keywords, read_settings

__all__ = ["LaPropConfig", "ShardedLaProp"]


def _help(text: str) -> dict[str, str]:
    """A field's flag help (``fsdp.arguments.add_optimizer_config_flags`` reads it)."""
    return {"help": f"--optimizer laprop: {text}."}


@dataclass(frozen=True, kw_only=True, slots=True)
class LaPropConfig:
    """LaProp's settings beyond megatron-core's ``OptimizerConfig`` fields: read from
    ``OptimizerConfig.laprop_<field>`` where set (megatron-core's rule for an emerging optimizer's
    keywords, ``_kwargs_from_config``), flags ``--laprop-<field>``; defaults LaProp's.

    ``lr``, ``weight_decay`` and ``betas`` (``adam_beta1``, ``adam_beta2``) are megatron-core's
    fields, read as megatron-core's default emerging-optimizer entry reads them.

    Attributes:
        eps: added to the second moment's root (>= 0).
        correct_bias: Adam's bias corrections of both moments.
        weight_decay_method: emerging-optimizers' ``WeightDecayT``.
    """

    eps: float = field(default=1e-8, metadata=_help("added to the second moment's root"))
    correct_bias: bool = field(
        default=True, metadata=_help("bias corrections of the two moments' EMAs")
    )
    weight_decay_method: WeightDecayT = field(
        default="decoupled", metadata=_help("how weight decay applies (emerging-optimizers')")
    )

    prefix: ClassVar[str] = "laprop"

    def __post_init__(self) -> None:
        if self.eps < 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")

    @classmethod
    def from_optimizer_config(cls, config: Any) -> LaPropConfig:
        """Reads ``config.laprop_<field>`` (``OptimizerConfig`` or Megatron's parsed args), the
        field's default where absent.

        Raises:
            ValueError: naming the ``laprop_`` field read.
        """
        return read_settings(cls, config)


class ShardedLaProp(LaProp):
    """``LaProp`` stepping each rank's local rows (module docstring).

    Args:
        params: params or param groups: row-sharded DTensors, replicated or plain tensors.
        *args, **kwargs: ``LaProp``'s (checked by it).

    Raises:
        ValueError: as ``LaProp``; ``frob_normalize=True``.
    """

    #: The state every param holds (``checkpointing.optimizer_state``).
    state_keys: ClassVar[tuple[str, ...]] = ("step", "exp_avg", "exp_avg_sq")
    label: ClassVar[str] = "LaProp"

    def __init__(self, params: ParamsT, *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        if self.frob_normalize:
            raise ValueError(
                "ShardedLaProp: frob_normalize=True rescales each param to its Frobenius norm, a "
                "sum over every rank's rows; the row-sharded step is elementwise and does not "
                "take it: use frob_normalize=False"
            )
        for group in self.param_groups:
            self._init_group(group, skip_non_grad_params=False)

    @classmethod
    def from_optimizer_config(cls, params: ParamsT, config: Any, **_: Any) -> ShardedLaProp:
        """megatron-core's ``--optimizer laprop`` keywords (``lr``, ``weight_decay``, ``betas``
        from ``adam_beta1/2``: its default emerging-optimizer entry) and ``LaPropConfig``'s.
        Other keywords (the factory's row group) are not used: the step is elementwise."""
        kwargs = _default_adam_based_eopt_config_to_kwargs("laprop", config, None, None)
        kwargs.update(as_keywords(LaPropConfig.from_optimizer_config(config)))
        return cls(params, **kwargs)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """``LaProp.step`` on every param's local rows (module docstring)."""
        if closure is not None:
            raise ValueError("closure is not supported")
        for group in self.param_groups:
            for param in group["params"]:
                rows = local_tensor(param)  # its storage; ``param.data`` would build a DTensor
                state = self.state[param]
                if rows.numel() == 0:  # no rows on this rank (grad None): the count only
                    state["step"] += 1
                elif param.grad is not None:  # LaProp skips a param without a grad
                    state["step"] += 1
                    self._step_rows(rows, local_tensor(param.grad), state, group)

    def _step_rows(
        self, rows: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict
    ) -> None:
        """LaProp's weight decay, update and ``p -= lr * update`` on this rank's rows (local
        tensors ``(rows, ...)``, ``rows`` updated in place)."""
        lr = group["lr"]
        self._apply_weight_decay_inplace(rows, grad, lr, group["weight_decay"])
        update = calculate_laprop_update(
            grad,
            local_tensor(state["exp_avg"]),
            local_tensor(state["exp_avg_sq"]),
            betas=group["betas"],
            eps=group["eps"],
            correct_bias=group["correct_bias"],
            step=state["step"],
        )
        rows.add_(update, alpha=-lr)

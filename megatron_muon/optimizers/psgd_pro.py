"""ShardedPSGDPro: emerging-optimizers' PSGDPro (PSGD-Kron-Whiten, Procrustes step) on
Megatron-FSDP's data-parallel row shards.

PSGDPro's preconditioner is Kronecker-factored: ``Q_0`` ``(m, m)`` and ``Q_1`` ``(n, n)`` for an
``(m, n)`` matrix, fitted each step from the whole momentum. So it runs on the engine's owner
compute (``engine.owner_compute``), as SOAP: each matrix's state (momentum ``exp_avg`` ``(m, n)``,
``Q_0``, ``Q_1`` and the two Lipschitz constants ``L`` ``(2,)``) and work on one owner rank,
placed with ``psgd_state_bytes`` and ``psgd_flops`` balanced. One matrix's work
(``psgd_matrix.psgd_matrix_update``) is ``PSGDPro.step``'s for one param, call for call
(emerging-optimizers' ``_update_precond_procrustes``, ``uniformize_q_in_place``,
``apply_preconditioner``, the RMS clip), minus what touches the param: the weight decay and
``p -= lr * update`` (each rank on its rows).
As in ``PSGDPro`` 0.3.0, ``state["step"]`` stays 0 (its step never counts it, so its
preconditioner lr schedule stays at ``precond_lr``); kept for exactness.

**Random numbers.** ``PSGDPro.step`` draws from the default generator of the param's device: the
damping noise (``randn_like`` of the momentum) and the random starts of its spectral-norm bounds.
One process draws them for all matrices in param order; here each owner draws only its own, and
the draws of the compiled bound functions are not a fixed count of numbers, so no rank can skip
the others' share of one stream. Instead each matrix's work runs on its own stream: the step
draws one seed from the CPU default generator on every rank (the ranks agree on the maximum, in
the step's one all_reduce), and matrix ``i``'s work runs with the default generators of the CPU
and the param's device seeded ``matrix_seed(step_seed, i)`` (``torch.random.fork_rng``: the
generators are back as they were after it). What is guaranteed: each matrix's update is bitwise
``PSGDPro.step`` on that full fp32 matrix run with its generator so seeded (the gradient being the
same bits), whatever the DP size and owner; every rank's generator advances by one draw per step;
a matrix every rank holds whole gets the same noise on every rank.

Refused at build time (``ValueError`` naming it): as ``engine.owner_compute`` (not a 2-D matrix,
tensor parallelism, HSDP, ``weight_decay_method="l2"``).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from emerging_optimizers.psgd import psgd as eo_psgd
from megatron.core.optimizer.emerging_optimizers import _kwargs_from_config
from torch.optim.optimizer import ParamsT

from megatron_muon.engine.owner_compute import OwnerComputedOptimizer
from megatron_muon.optimizers.psgd_matrix import (
    SEED_BOUND,
    STATE_KEYS,
    PsgdProConfig,
    matrix_rng,
    matrix_seed,
    psgd_flops,
    psgd_matrix_update,
    psgd_state_bytes,
)

__all__ = ["ShardedPSGDPro"]


class ShardedPSGDPro(OwnerComputedOptimizer, eo_psgd.PSGDPro):
    """PSGDPro on data-parallel row-sharded params (Megatron-FSDP); owner compute, each matrix
    on its own random stream (module docstring).

    Args:
        params, lr, weight_decay, momentum, weight_decay_method, beta_lip, precond_lr,
            precond_init_scale, damping_noise_scale, min_precond_lr, warmup_steps,
            max_update_rms: ``PSGDPro``'s.
        dp_group: the process group the params' rows are sharded over (``None``: the default
            group). Collective over it: construction and ``step``.

    Raises:
        ValueError: the settings and params the module docstring lists.
    """

    STATE_KEYS: ClassVar[tuple[str, ...]] = STATE_KEYS
    name: ClassVar[str] = "psgd_pro"
    counts_steps: ClassVar[bool] = False  # as PSGDPro 0.3.0 (module docstring)
    config_class: ClassVar[Any] = PsgdProConfig
    state_bytes = staticmethod(psgd_state_bytes)
    flops = staticmethod(psgd_flops)

    def __init__(
        self, params: ParamsT, *, dp_group: dist.ProcessGroup | None = None, **psgd_kwargs: Any
    ) -> None:
        eo_psgd.PSGDPro.__init__(self, params, **psgd_kwargs)
        self.step_seed = 0
        self._setup_owners(dp_group)

    @classmethod
    def from_optimizer_config(
        cls, param_groups: ParamsT, config: Any, dp_group: dist.ProcessGroup | None
    ) -> ShardedPSGDPro:
        """``--optimizer psgd_pro`` from megatron-core's ``OptimizerConfig``, on ``dp_group``:
        ``lr``, ``weight_decay`` and ``PsgdProConfig``'s fields (``psgd_pro_<field>``, as
        megatron-core's ``_kwargs_from_config`` names them). megatron-core 0.19.2's own entry also
        passes ``betas``, which ``PSGDPro`` does not take (its build raises ``TypeError``).

        Raises:
            ValueError: a ``psgd_pro_*`` value ``PsgdProConfig`` refuses (naming the field).
        """
        settings = asdict(PsgdProConfig.from_optimizer_config(config))
        base = _kwargs_from_config(eo_psgd.PSGDPro, cls.name, config)
        return cls(param_groups, dp_group=dp_group, **{**base, **settings})

    def init_matrix_state(self, shape: tuple[int, int], device: torch.device) -> dict[str, Any]:
        """PSGDPro's initial state of one whole ``(m, n)`` matrix, as its first step makes it."""
        grad = torch.empty(shape, device=device)
        q_list, lip_list = eo_psgd._init_psgd_kron_states(grad, self.precond_init_scale)
        return {
            "step": 0,
            "exp_avg": torch.zeros_like(grad),
            "Q_0": q_list[0],
            "Q_1": q_list[1],
            "L": torch.stack(lip_list),
        }

    def _values_to_agree(self) -> list[int]:
        return [int(torch.randint(SEED_BOUND, ()).item())]  # the CPU default generator

    def _prepare_step(self, agreed: list[int]) -> None:
        self.step_seed = agreed[0]

    def _matrix_update(
        self, index: int, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        """``psgd_matrix_update`` on matrix ``index``'s own random stream."""
        with matrix_rng(matrix_seed(self.step_seed, index), grad.device):
            return psgd_matrix_update(self, state, grad, group)

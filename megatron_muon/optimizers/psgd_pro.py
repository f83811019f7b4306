"""ShardedPSGDPro: emerging-optimizers' PSGDPro (PSGD-Kron-Whiten, Procrustes step) on
Megatron-FSDP's data-parallel row shards.

PSGDPro's preconditioner is Kronecker-factored: ``Q_0`` ``(m, m)`` and ``Q_1`` ``(n, n)`` for an
``(m, n)`` matrix, fitted each step from the whole momentum. So it runs on the engine's owner
compute (``engine.owner_compute``), as SOAP: each matrix's state (momentum ``exp_avg`` ``(m, n)``,
``Q_0``, ``Q_1`` and the two Lipschitz constants ``L`` ``(2,)``) and work on one owner rank,
placed with ``psgd_state_bytes`` and ``psgd_flops`` balanced. One matrix's work
(``psgd_matrix_update``) is ``PSGDPro.step``'s for one param, call for call (emerging-optimizers'
``_update_precond_procrustes``, ``uniformize_q_in_place``, ``apply_preconditioner``, the RMS clip),
minus what touches the param: the weight decay and ``p -= lr * update`` (each rank on its rows).
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

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from emerging_optimizers.psgd import psgd as eo_psgd
from emerging_optimizers.psgd import psgd_kron_contractions, psgd_utils
from emerging_optimizers.soap.soap import _clip_update_rms_in_place
from megatron.core.optimizer.emerging_optimizers import _kwargs_from_config
from torch.optim.optimizer import ParamsT

from megatron_muon.engine.owner_compute import OwnerComputedOptimizer

__all__ = [
    "PsgdProConfig",
    "ShardedPSGDPro",
    "matrix_rng",
    "matrix_seed",
    "psgd_flops",
    "psgd_matrix_update",
    "psgd_state_bytes",
]

STATE_KEYS = ("step", "exp_avg", "Q_0", "Q_1", "L")
_SEED_BOUND = 2**31 - 1  # step seeds are int32 (the step's all_reduce)


def _help(text: str) -> dict[str, str]:
    return {"help": f"--optimizer psgd_pro: {text}."}


@dataclass(frozen=True, kw_only=True, slots=True)
class PsgdProConfig:
    """PSGDPro's settings beyond ``lr`` and ``weight_decay``, as
    ``OptimizerConfig.psgd_pro_<field>`` (megatron-core 0.19.2 has no such field: Megatron-LM's
    flag sets it, ``integrations`` carries it over), names and defaults ``PSGDPro``'s."""

    momentum: float = field(default=0.9, metadata=_help("momentum of the gradient's EMA"))
    beta_lip: float = field(default=0.9, metadata=_help("EMA beta of the Lipschitz constants"))
    precond_lr: float = field(default=0.1, metadata=_help("preconditioner learning rate"))
    precond_init_scale: float = field(default=1.0, metadata=_help("initial preconditioner scale"))
    damping_noise_scale: float = field(default=0.1, metadata=_help("damping noise scale"))
    min_precond_lr: float = field(default=0.01, metadata=_help("least preconditioner lr"))
    warmup_steps: int = field(default=10000, metadata=_help("preconditioner lr warmup steps"))
    max_update_rms: float = field(default=0.0, metadata=_help("update RMS clip (0: none)"))

    def __post_init__(self) -> None:
        for name in ("momentum", "beta_lip"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("precond_lr", "precond_init_scale", "min_precond_lr", "warmup_steps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("damping_noise_scale", "max_update_rms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_optimizer_config(cls, config: Any) -> PsgdProConfig:
        """Reads ``config.psgd_pro_<field>`` where present (``OptimizerConfig`` or parsed args).

        Raises:
            ValueError: naming the ``psgd_pro_`` field read.
        """
        values = {f.name: getattr(config, f"psgd_pro_{f.name}", None) for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in values.items() if v is not None})
        except ValueError as error:  # every message starts with the field's name
            raise ValueError(f"psgd_pro_{error}") from None


def psgd_state_bytes(shape: tuple[int, int]) -> int:
    """Bytes of one ``(m, n)`` matrix's PSGDPro state (fp32 momentum, ``Q_0``, ``Q_1``, ``L``)."""
    m, n = shape
    return 4 * (m * n + m * m + n * n + 2)


def psgd_flops(shape: tuple[int, int]) -> int:
    """Approximate FLOPs of one ``(m, n)`` matrix's PSGDPro step: two preconditioner applications
    (``2 m n (m + n)`` each), the two covariances (``2 m n (m + n)``), and per factor the update,
    the Procrustes step and the norm bounds (about ``10 k^3`` for a ``k x k`` factor)."""
    m, n = shape
    return 3 * 2 * m * n * (m + n) + 10 * (m**3 + n**3)


def matrix_seed(step_seed: int, index: int) -> int:
    """The seed of matrix ``index``'s random numbers in a step whose seed is ``step_seed``."""
    return index * (_SEED_BOUND + 1) + step_seed


@contextmanager
def matrix_rng(seed: int, device: torch.device) -> Iterator[None]:
    """The default generators of the CPU and of ``device`` seeded ``seed`` inside, as they were
    after (``torch.random.fork_rng``)."""
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        for index in devices:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


@torch.no_grad()
def psgd_matrix_update(
    optimizer: eo_psgd.PSGDPro, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]
) -> torch.Tensor:
    """One matrix's PSGDPro update direction (the param then moves by ``-lr`` times it).

    Args:
        optimizer: the PSGDPro whose settings apply (``warmup_steps``, ``damping_noise_scale``,
            ``max_update_rms``).
        state: the matrix's whole state (``STATE_KEYS``; plain tensors): ``exp_avg`` updated in
            place, ``Q_0``, ``Q_1``, ``L`` replaced (as ``PSGDPro.step`` rebinds them).
        grad: the whole gradient ``(m, n)``, fp32.
        group: the param group (``momentum``, ``precond_lr``, ``min_precond_lr``, ``beta_lip``).

    Returns:
        The whole update ``(m, n)``, fp32 (after the RMS clip, if any).
    """
    exp_avg = state["exp_avg"]
    exp_avg.lerp_(grad, 1 - group["momentum"])
    precond_lr = eo_psgd._get_precond_lr(
        group["precond_lr"], state["step"], group["min_precond_lr"], optimizer.warmup_steps
    )
    q_list, lip_list = eo_psgd._update_precond_procrustes(
        [state["Q_0"], state["Q_1"]],
        list(state["L"].unbind()),
        exp_avg,
        optimizer.damping_noise_scale,
        precond_lr,
        group["beta_lip"],
    )
    psgd_utils.uniformize_q_in_place(q_list)
    update = psgd_kron_contractions.apply_preconditioner(q_list, exp_avg)
    if optimizer.max_update_rms != 0:  # the clip returns at once for 0 (skipped: compiled)
        _clip_update_rms_in_place(update, optimizer.max_update_rms)
    state["Q_0"], state["Q_1"] = q_list
    state["L"] = torch.stack(lip_list)
    return update


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
        return [int(torch.randint(_SEED_BOUND, ()).item())]  # the CPU default generator

    def _prepare_step(self, agreed: list[int]) -> None:
        self.step_seed = agreed[0]

    def _matrix_update(
        self, index: int, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        """``psgd_matrix_update`` on matrix ``index``'s own random stream."""
        with matrix_rng(matrix_seed(self.step_seed, index), grad.device):
            return psgd_matrix_update(self, state, grad, group)

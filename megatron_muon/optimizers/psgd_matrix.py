"""PSGDPro's work on one whole matrix, its state, settings, costs and random streams.

emerging-optimizers' ``PSGDPro.step`` (PSGD-Kron-Whiten with the Procrustes step) does per param:
weight decay, the momentum EMA ``exp_avg``, a fit of the Kronecker-factored preconditioner
``Q = [Q_0 (m, m), Q_1 (n, n)]`` with Lipschitz constants ``L`` on the damped momentum
(``_update_precond_procrustes``), ``uniformize_q_in_place``, the preconditioned momentum
(``apply_preconditioner``) and the RMS clip, then ``p -= lr * update``. ``psgd_matrix_update`` is
that block, call for call, minus what touches the param (the weight decay and the update: each
rank on its own rows, ``engine.owner_compute``). Inputs and outputs are plain local tensors
(fp32): the whole gradient ``(m, n)`` and the whole state of the matrix, as its owner holds it
(``psgd_pro``). ``matrix_seed`` / ``matrix_rng``: each matrix's random stream (``psgd_pro``'s
docstring says why and what equality holds).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from emerging_optimizers.psgd import psgd as eo_psgd
from emerging_optimizers.psgd import psgd_kron_contractions, psgd_utils
from emerging_optimizers.soap.soap import _clip_update_rms_in_place

from megatron_muon.optimizers.settings import read_settings

__all__ = [
    "SEED_BOUND",
    "STATE_KEYS",
    "PsgdProConfig",
    "matrix_rng",
    "matrix_seed",
    "psgd_flops",
    "psgd_matrix_update",
    "psgd_state_bytes",
]

STATE_KEYS = ("step", "exp_avg", "Q_0", "Q_1", "L")
SEED_BOUND = 2**31 - 1  # step seeds are int32 (the step's all_reduce)


def _help(text: str) -> dict[str, str]:
    return {"help": f"--optimizer psgd_pro: {text}."}


@dataclass(frozen=True, kw_only=True, slots=True)
class PsgdProConfig:
    """PSGDPro's settings beyond ``lr`` and ``weight_decay``, as
    ``OptimizerConfig.psgd_pro_<field>`` (megatron-core 0.19.2 has no such field: Megatron-LM's
    flag sets it, ``integrations`` carries it over), names and defaults ``PSGDPro``'s."""

    prefix: ClassVar[str] = "psgd_pro"

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
        """``config.psgd_pro_<field>`` where present (``settings.read_settings``).

        Raises:
            ValueError: naming the ``psgd_pro_`` field read.
        """
        return read_settings(cls, config)


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
    return index * (SEED_BOUND + 1) + step_seed


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

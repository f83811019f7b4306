"""SOAP's per-matrix work on one whole matrix, from emerging-optimizers' own functions.

emerging-optimizers 0.3.0's ``SOAP.step`` runs, for each param, one block of work on the whole
matrix: the Kronecker factors ``L`` (``m x m``) and ``R`` (``n x n``) take the gradient's outer
products (``update_kronecker_factors``, or ``update_kronecker_factors_kl_shampoo``), the eigenbases
``Q_L``/``Q_R`` and the Adam moments are refreshed (``update_eigenbasis_and_exp_avgs``), the
gradient is projected into the eigenbases (``precondition``), Adam runs there
(``calculate_adam_update``) and the result is projected back. ``soap_matrix_update`` is that block,
call for call (the same functions, arguments and precision contexts), minus the two things that
touch the param: the weight decay (elementwise on the param: decoupled, independent or palm; each
rank applies it to its own rows) and ``p -= lr * update`` (each rank its rows of the update).

Inputs and outputs are plain local tensors (fp32): the whole gradient ``(m, n)`` and the whole
state of the matrix, as its owner rank holds them (``sharded_soap``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import torch
from emerging_optimizers import utils as eo_utils
from emerging_optimizers.scalar_optimizers import update_functions
from emerging_optimizers.soap import soap as eo_soap

from megatron_muon.optimizers.settings import read_settings

__all__ = ["STATE_KEYS", "SoapConfig", "init_matrix_state", "soap_matrix_update"]

# The state SOAP keeps per matrix (``SOAP._init_group``): the step count (a Python int), the inner
# Adam's moments ``(m, n)``, the Kronecker factors and their eigenbases ``(m, m)``, ``(n, n)``.
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R")
TENSOR_KEYS = STATE_KEYS[1:]


def _help(text: str) -> dict[str, str]:
    """A field's flag help (``fsdp.arguments.add_optimizer_config_flags`` reads it)."""
    return {"help": f"--optimizer soap: {text}."}


@dataclass(frozen=True, kw_only=True, slots=True)
class SoapConfig:
    """Megatron's SOAP settings (``OptimizerConfig.soap_*``), same names without the prefix,
    defaults megatron-core 0.19.2's.

    Attributes:
        shampoo_beta: decay of the Kronecker factors' running average (SOAP's ``shampoo_beta``),
            in [0, 1).
        precondition_frequency: steps between eigenbasis updates. emerging-optimizers 0.3.0's
            SOAP has no such argument and updates every step (megatron-core passes nothing for
            it), so only 1 runs exactly.
        use_kl_shampoo: KL-Shampoo's correction of the factors (SOAP's ``use_kl_shampoo``).
    """

    prefix: ClassVar[str] = "soap"

    shampoo_beta: float = field(
        default=0.95, metadata=_help("decay of the Kronecker factors' running average, in [0, 1)")
    )
    precondition_frequency: int = field(
        default=1,
        metadata=_help(
            "steps between eigenbasis updates; emerging-optimizers 0.3.0 updates every step, so "
            "only 1 is accepted"
        ),
    )
    use_kl_shampoo: bool = field(
        default=True, metadata=_help("KL-Shampoo's correction of the Kronecker factors")
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.shampoo_beta < 1.0:
            raise ValueError(f"shampoo_beta must be in [0, 1), got {self.shampoo_beta}")
        if self.precondition_frequency != 1:
            raise ValueError(
                f"precondition_frequency must be 1, got {self.precondition_frequency}: "
                "emerging-optimizers 0.3.0's SOAP (megatron-core's soap) updates its eigenbasis "
                "every step and has no such setting, so another value would not run as asked"
            )

    @classmethod
    def from_optimizer_config(cls, config: Any) -> SoapConfig:
        """Reads ``config.soap_<field>`` (``OptimizerConfig`` or Megatron's parsed args).

        Raises:
            ValueError: naming the ``soap_`` field read.
        """
        return read_settings(cls, config)


def init_matrix_state(shape: tuple[int, int], device: torch.device) -> dict[str, Any]:
    """A matrix's initial SOAP state, as ``SOAP._init_group`` makes it (zeros, identities).

    The eigenbases are column-major (the transpose of a row-major identity: the same values), as
    every eigenbasis LAPACK returns later is: a checkpoint loaded into fresh state then keeps the
    memory layout of the running state, on which BLAS rounds alike (on another layout it rounds
    differently, measured: 6e-8 after two steps).
    """
    rows, cols = shape
    factor_l, factor_r = eo_soap.init_kronecker_factors(torch.Size(shape), device=device)
    return {
        "step": 0,
        "exp_avg": torch.zeros(shape, dtype=torch.float32, device=device),
        "exp_avg_sq": torch.zeros(shape, dtype=torch.float32, device=device),
        "L": factor_l,
        "R": factor_r,
        "Q_L": torch.eye(rows, device=device).t(),
        "Q_R": torch.eye(cols, device=device).t(),
    }


@torch.no_grad()
def soap_matrix_update(
    optimizer: eo_soap.SOAP, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]
) -> torch.Tensor:
    """One matrix's SOAP update direction (the param then moves by ``-lr`` times it).

    Args:
        optimizer: the SOAP whose settings apply (``use_kl_shampoo``, precisions, ...).
        state: the matrix's whole state (``STATE_KEYS``; plain tensors): ``L``/``R`` updated in
            place, the moments and eigenbases replaced by new tensors (as ``SOAP.step`` rebinds
            them), the step count not touched (the caller counts it on every rank).
        grad: the whole gradient ``(m, n)``, fp32.
        group: the param group (``betas``, ``shampoo_beta``, ``eps``).

    Returns:
        The whole update ``(m, n)``, fp32 (after SOAP's RMS clipping, if any).
    """
    curr_iter_1_based = state["step"] + 1
    kronecker_factor_list = [state["L"], state["R"]]
    eigenbasis_list = [state["Q_L"], state["Q_R"]]
    if optimizer.use_kl_shampoo:
        update_factors = partial(
            eo_soap.update_kronecker_factors_kl_shampoo,
            eigenbasis_list=eigenbasis_list,
            eps=group["eps"],
        )
    else:
        update_factors = eo_soap.update_kronecker_factors
    shampoo_beta = group["shampoo_beta"]
    if optimizer.correct_shampoo_beta_bias:
        shampoo_beta = 1 - (1 - shampoo_beta) / (1 - shampoo_beta**curr_iter_1_based)
    with eo_utils.fp32_matmul_precision(optimizer.fp32_matmul_prec):
        update_factors(
            kronecker_factor_list=kronecker_factor_list, grad=grad, shampoo_beta=shampoo_beta
        )
    use_eigh = optimizer.use_eigh if state["step"] != 0 else True  # eigh the first time
    with eo_utils.fp32_matmul_precision(optimizer.qr_fp32_matmul_prec):
        eigenbasis_list, exp_avg, exp_avg_sq = eo_soap.update_eigenbasis_and_exp_avgs(
            kronecker_factor_list=kronecker_factor_list,
            eigenbasis_list=eigenbasis_list,
            exp_avg_sq=state["exp_avg_sq"],
            exp_avg=state["exp_avg"],
            use_eigh=use_eigh,
            power_iter_steps=optimizer.power_iter_steps,
        )
    with eo_utils.fp32_matmul_precision(optimizer.fp32_matmul_prec):
        grad_projected = eo_soap.precondition(
            grad, eigenbasis_list=eigenbasis_list, dims=[[0], [0]]
        )
    adam_update = update_functions.calculate_adam_update(
        grad_projected,
        exp_avg,
        exp_avg_sq,
        betas=group["betas"],
        eps=group["eps"],
        correct_bias=optimizer.correct_bias,
        nesterov=optimizer.nesterov,
        step=curr_iter_1_based,
    )
    with eo_utils.fp32_matmul_precision(optimizer.fp32_matmul_prec):
        update = eo_soap.precondition(adam_update, eigenbasis_list=eigenbasis_list, dims=[[0], [1]])
    if optimizer.max_update_rms != 0:  # SOAP's clip returns at once for 0 (skipped: compiled)
        eo_soap._clip_update_rms_in_place(update, optimizer.max_update_rms)
    state["exp_avg"], state["exp_avg_sq"] = exp_avg, exp_avg_sq
    state["Q_L"], state["Q_R"] = eigenbasis_list
    return update

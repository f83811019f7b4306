"""ShardedSOAP: emerging-optimizers' SOAP, exact on Megatron-FSDP's data-parallel row shards.

SOAP's state and work are whole-matrix (``soap_matrix``): Kronecker factors ``L`` ``(m, m)`` and
``R`` ``(n, n)``, their eigenbases, the inner Adam's moments ``(m, n)``, and per step GEMMs and an
eigenbasis refresh of the whole matrix. So it runs on the engine's owner compute
(``engine.owner_compute``: each matrix's state and work on one owner rank of its data-parallel
group, chosen with SOAP's state bytes and FLOPs balanced, ``soap_plan``; gradient rows to the owner
through ``exchange.OwnerExchange``, update rows back); this adapter says what SOAP's state is
(``soap_matrix.init_matrix_state``) and what one matrix's work is (``soap_matrix_update``:
emerging-optimizers' own ``update_kronecker_factors(_kl_shampoo)``,
``update_eigenbasis_and_exp_avgs``, ``precondition``, ``calculate_adam_update``). Each rank applies
SOAP's weight decay (elementwise on the param: decoupled, independent or palm) and
``p -= lr * update`` to its own rows. The arithmetic per matrix is SOAP's, on the same fp32 full
matrix, so the result is stock ``SOAP.step``'s on the full tensors up to the gradient's own
reduction order.

**State layout and checkpoints.** ``state[p]`` holds SOAP's keys (``soap_matrix.STATE_KEYS``),
owner-held where ``p`` is row-sharded (``engine.owner_state``: the whole tensor on the owner, 0
rows elsewhere; DCP stores each once under the param's name, and a checkpoint reloads at any DP
size, the owner of each matrix changing with it), whole on every rank where every rank holds ``p``
whole. ``step`` is a Python int, the same on every rank.

Refused at build time (``ValueError`` naming it): a param that is not a real 2-D matrix (as SOAP),
tensor parallelism (a tensor-parallel mesh axis), a row-sharded param with more than one
data-parallel mesh axis (HSDP), ``weight_decay_method="l2"`` (it adds the whole weight to the
gradient on the owner), CUDA ``stream_list``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from emerging_optimizers.soap.soap import SOAP
from megatron.core.optimizer.emerging_optimizers import _default_adam_based_eopt_config_to_kwargs
from torch.optim.optimizer import ParamsT

from megatron_muon.engine.owner_compute import OwnerComputedOptimizer
from megatron_muon.optimizers.soap_matrix import (
    STATE_KEYS,
    SoapConfig,
    init_matrix_state,
    soap_matrix_update,
)
from megatron_muon.optimizers.soap_plan import soap_flops, soap_state_bytes

__all__ = ["ShardedSOAP"]


class ShardedSOAP(OwnerComputedOptimizer, SOAP):
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

    STATE_KEYS: ClassVar[tuple[str, ...]] = STATE_KEYS
    name: ClassVar[str] = "soap"
    #: The dataclass of the ``OptimizerConfig.<name>_*`` settings (checked, flags derived).
    config_class: ClassVar[Any] = SoapConfig
    state_bytes = staticmethod(soap_state_bytes)
    flops = staticmethod(soap_flops)

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
        if soap_kwargs.get("stream_list") is not None:
            raise ValueError("ShardedSOAP: stream_list is not supported (owner compute)")
        self._init_reference(params, lr, betas, shampoo_beta, eps, weight_decay, **soap_kwargs)
        self._setup_owners(dp_group)

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
        cls.config_class.from_optimizer_config(config)
        kwargs = _default_adam_based_eopt_config_to_kwargs(cls.name, config, None, None)
        return cls(param_groups, dp_group=dp_group, **kwargs)

    def _init_reference(self, *args: Any, **kwargs: Any) -> None:
        """The optimizer's own constructor (``SOAP``'s; ``ShardedREKLS``: ``REKLS``'s)."""
        SOAP.__init__(self, *args, **kwargs)

    def init_matrix_state(self, shape: tuple[int, int], device: torch.device) -> dict[str, Any]:
        """SOAP's initial state of one whole ``(m, n)`` matrix (``soap_matrix``)."""
        return init_matrix_state(shape, device)

    def _matrix_update(
        self, index: int, state: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        """``soap_matrix_update``: SOAP's work on one whole matrix."""
        return soap_matrix_update(self, state, grad, group)

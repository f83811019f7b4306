"""ShardedREKLS: emerging-optimizers' REKLS (SOAP with ``use_eigh`` and KL-Shampoo) on
Megatron-FSDP's row shards.

REKLS is SOAP whose eigenbases come from ``eigh`` every step (``use_eigh=True``) with KL-Shampoo's
factor updates (``use_kl_shampoo=True``): REKLS's own constructor sets both. ``ShardedREKLS`` is
``ShardedSOAP`` (owner compute, SOAP's per-matrix work and state) built through REKLS's
constructor, so its settings are REKLS's own and ``isinstance(optimizer, REKLS)`` holds. Its
settings from megatron-core's ``OptimizerConfig`` are those megatron-core's registry entry reads
(``rekls_shampoo_beta``, ``betas`` from the Adam betas); ``RekLsConfig`` checks them and gives
the ``--rekls-*`` flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch.distributed as dist
from emerging_optimizers import mixin as opt_mixin
from emerging_optimizers.soap.rekls import REKLS
from torch.optim.optimizer import ParamsT

from megatron_muon.optimizers.settings import read_settings
from megatron_muon.optimizers.soap import ShardedSOAP

__all__ = ["RekLsConfig", "ShardedREKLS"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RekLsConfig:
    """REKLS's settings beyond ``lr``, ``weight_decay`` and the Adam betas, as
    ``OptimizerConfig.rekls_<field>`` (megatron-core 0.19.2 has no such field: Megatron-LM's flag
    sets it, ``integrations`` carries it over), defaults REKLS's.

    Attributes:
        shampoo_beta: decay of the Kronecker factors' running average, in [0, 1).
    """

    prefix: ClassVar[str] = "rekls"

    shampoo_beta: float = field(
        default=0.95,
        metadata={"help": "--optimizer rekls: decay of the Kronecker factors' average, in [0, 1)."},
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.shampoo_beta < 1.0:
            raise ValueError(f"shampoo_beta must be in [0, 1), got {self.shampoo_beta}")

    @classmethod
    def from_optimizer_config(cls, config: Any) -> RekLsConfig:
        """``config.rekls_<field>`` where present (``settings.read_settings``).

        Raises:
            ValueError: naming the ``rekls_`` field read.
        """
        return read_settings(cls, config)


class ShardedREKLS(ShardedSOAP, REKLS):
    """REKLS on data-parallel row-sharded params (Megatron-FSDP), exact; ``ShardedSOAP``'s owner
    compute with REKLS's settings.

    Args:
        params, lr, betas, shampoo_beta, eps, weight_decay, weight_decay_method: ``REKLS``'s.
        dp_group: as ``ShardedSOAP``'s.
    """

    name: ClassVar[str] = "rekls"
    config_class: ClassVar[Any] = RekLsConfig

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        shampoo_beta: float = 0.95,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        weight_decay_method: opt_mixin.WeightDecayT = "decoupled",
        dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        # REKLS's constructor (``_init_reference``) sets use_eigh and use_kl_shampoo.
        super().__init__(
            params,
            lr,
            betas,
            shampoo_beta,
            eps,
            weight_decay,
            dp_group=dp_group,
            weight_decay_method=weight_decay_method,
        )

    def _init_reference(self, *args: Any, **kwargs: Any) -> None:
        REKLS.__init__(self, *args, **kwargs)

"""The owner-computed optimizers by name: ``OWNER_COMPUTED`` maps each registry name
(``OptimizerConfig.optimizer``, ``--optimizer``) to its adapter of ``engine.owner_compute``
(each matrix's state and work on one owner rank), for the factory's table."""

from __future__ import annotations

from megatron_muon.engine.owner_compute import OwnerComputedOptimizer
from megatron_muon.optimizers.psgd_pro import ShardedPSGDPro
from megatron_muon.optimizers.rekls import ShardedREKLS
from megatron_muon.optimizers.soap import ShardedSOAP

__all__ = ["OWNER_COMPUTED"]

OWNER_COMPUTED: dict[str, type[OwnerComputedOptimizer]] = {
    cls.name: cls for cls in (ShardedSOAP, ShardedREKLS, ShardedPSGDPro)
}

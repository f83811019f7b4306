"""megatron-core's ``TensorParallelAdaptiveMuon`` made to compute emerging-optimizers' AdaptiveMuon.

megatron-core 0.19.2's ``TensorParallelAdaptiveMuon`` (``--optimizer adaptive_muon``) runs
``TensorParallelMuon.__init__`` only, so two things of emerging-optimizers 0.3.0's
``AdaptiveMuon.step``, which it steps with, are wrong:

- ``AdaptiveMuon.step`` reads ``self.scale_mode`` (set by ``AdaptiveMuon.__init__`` alone): the
  first step stops with ``AttributeError: 'TensorParallelAdaptiveMuon' object has no attribute
  'scale_mode'``;
- its ``orthogonalize`` is ``TensorParallelMuon``'s, whose Newton-Schulz result is already
  multiplied by Muon's scale, and ``AdaptiveMuon.step`` multiplies by the scale again after the
  second moment: the scale would be applied twice.

``TensorParallelAdaptiveMuonFixed`` sets ``scale_mode`` and ``extra_scale_factor`` and
orthogonalizes without the scale (``optimizers.adaptive_muon.raw_orthogonalize_fn``:
``newton_schulz_tp`` as ``TensorParallelMuon`` calls it), so a step is ``AdaptiveMuon``'s: raw
Newton-Schulz, second moment, Muon's scale once (QKV split and tensor parallelism as
``TensorParallelMuon`` has them). At tensor-parallel size > 1 the second moment and the scale
apply to the TP rank's partition (``AdaptiveMuon.step`` on the TP-local param), which
``ShardedAdaptiveMuon`` matches for every moment2 method (``optimizers.moment2_partitions``).
``install()`` puts it in megatron-core's emerging-optimizer registry for ``"adaptive_muon"``;
``megatron_lm.install()`` calls it after its megatron-core version check. Without Megatron-FSDP,
Megatron-LM's loop then trains with it; with Megatron-FSDP the factory builds
``ShardedAdaptiveMuon`` instead.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from megatron.core.optimizer.emerging_optimizers import TensorParallelAdaptiveMuon

from megatron_muon.integrations.megatron_version import check_megatron_core_version
from megatron_muon.optimizers.adaptive_muon import raw_orthogonalize_fn

__all__ = ["TensorParallelAdaptiveMuonFixed", "install"]


class TensorParallelAdaptiveMuonFixed(TensorParallelAdaptiveMuon):
    """``TensorParallelAdaptiveMuon`` (same keywords and defaults) whose step is ``AdaptiveMuon``'s
    (module docstring)."""

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        signature = inspect.signature(TensorParallelAdaptiveMuon.__init__)
        bound = signature.bind(self, params, *args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        # AdaptiveMuon._apply_muon_scale reads these two.
        self.scale_mode = values["scale_mode"]
        self.extra_scale_factor = values["extra_scale_factor"]
        self.scaled_orthogonalize_fn = raw_orthogonalize_fn(
            values["num_ns_steps"], values["coefficient_type"], values["tp_mode"]
        )


def install() -> None:
    """Registers ``TensorParallelAdaptiveMuonFixed`` as megatron-core's ``"adaptive_muon"``.

    Idempotent. Raises RuntimeError on a megatron-core version this fix was not checked against.
    """
    check_megatron_core_version("megatron_muon.integrations.adaptive_muon_fix")
    registry: Any = importlib.import_module("megatron.core.optimizer.emerging_optimizers")
    registry._EMERGING_OPTIMIZERS["adaptive_muon"].optimizer_cls = TensorParallelAdaptiveMuonFixed

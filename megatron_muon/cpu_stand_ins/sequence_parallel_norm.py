"""CPU stand-in for the norm of sequence parallelism (``--sequence-parallel``) in the local spec.

With ``--transformer-impl local`` and no Apex (always so without a GPU), megatron-core's local GPT
spec builds its norms with ``WrappedTorchNorm`` (``torch.nn.LayerNorm`` / ``RMSNorm``), which
asserts ``not config.sequence_parallel`` (megatron-core 0.19.2, ``torch_norm.py:50``). MoE with
tensor parallelism > 1 requires sequence parallelism, so on CPU ranks that assert stops every MoE
model at TP = 2 before it is built. On a GPU, Transformer Engine's or Apex's norm takes it.

What sequence parallelism asks of a norm is one thing: its weight and bias carry
``sequence_parallel = True``, so that ``finalize_model_grads`` sums their gradients over the TP
group (each TP rank saw only its slice of the sequence;
``_allreduce_non_tensor_model_parallel_grads``; Apex's ``FusedLayerNorm`` and Transformer Engine's
norms set the same attribute). The norm's math is per token, the same on a slice of the sequence
as on the whole. The stand-in builds the norm ``WrappedTorchNorm`` builds (from a shallow copy of
the config with ``sequence_parallel=False``, so every other check of the original still runs) and
marks its parameters.
"""

from __future__ import annotations

import copy
from typing import Any

from megatron_muon.cpu_stand_ins._replace import MARK, set_stand_in

__all__ = ["patch"]


def _sequence_parallel_torch_norm(original_new: Any) -> Any:
    def new(cls: type, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        per_token = copy.copy(config)
        per_token.sequence_parallel = False
        norm = original_new(cls, per_token, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return new


def patch() -> None:
    """``WrappedTorchNorm(config, ...)`` with ``config.sequence_parallel``: the torch norm, its
    params marked ``sequence_parallel`` (their grads are summed over TP by the loop)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original_new = WrappedTorchNorm.__new__
    if getattr(original_new, MARK, False):
        return
    replacement = staticmethod(_sequence_parallel_torch_norm(original_new))
    setattr(replacement.__func__, MARK, True)
    set_stand_in(WrappedTorchNorm, "__new__", replacement)

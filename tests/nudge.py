"""The floor runs' perturbation (tests/run_comparison.py): every fp32 weight one ulp up.

Used by the drivers of Megatron-LM (``tests/megatron_lm_driver.py``,
``MEGATRON_MUON_NUDGE_WEIGHTS``) and Megatron-Bridge (``tests/bridge/bridge_driver.py``, a spec's
``nudge``) on each rank after the model and optimizer are set up (and a checkpoint loaded),
before the first iteration, and by the TP parity ranks and reference (``tests/tp_parity.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def one_ulp_up_(tensor: torch.Tensor) -> None:
    """``tensor`` (any shape, fp32) to the next representable value toward +inf, in place."""
    tensor.copy_(torch.nextafter(tensor, torch.full_like(tensor, torch.inf)))


def nudge_weights(model: Iterable[torch.nn.Module]) -> None:
    """Every weight of every chunk of ``model`` one ulp up, in place. A DTensor (Megatron-FSDP) is
    nudged in its local shard (this rank's rows; each rank nudges its own). A weight of another
    dtype than fp32 is refused (bf16 runs keep fp32 main copies this would not reach), so that a
    floor run is never silently unperturbed."""
    from torch.distributed.tensor import DTensor

    for chunk in model:
        for name, param in chunk.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if local.dtype != torch.float32:
                raise ValueError(
                    f"floor run: {name} is {local.dtype}; only fp32 weights are nudged one ulp up"
                )
            with torch.no_grad():
                one_ulp_up_(local)

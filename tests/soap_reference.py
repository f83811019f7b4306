"""What the SOAP tests share: torch.compile off, and megatron-core's soap on a full GPTModel.

``EAGER``: emerging-optimizers compiles its Adam update (``calculate_adam_update``) per shape,
~15 s a process on 2 cores; the tests run it eager on both sides, as the torchrun launches of
tests/torchrun.py do (``TORCHDYNAMO_DISABLE``): the same functions either way.
"""

from __future__ import annotations

import torch

from tests import gpt_parity

SHAMPOO_BETA = 0.9


def EAGER():  # noqa: N802  (a context, named like the constant it stands for)
    """torch.compile off (emerging-optimizers' compiled update functions run eager)."""
    return torch._dynamo.config.patch(disable=True)


class SoapReference(gpt_parity.Reference):
    """megatron-core's soap on full tensors: SOAP (hidden matrices) + AdamW (the rest)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from emerging_optimizers.soap import SOAP

        self.model = model
        named = list(model.named_parameters())
        matrices = [p for n, p in named if gpt_parity.reference_routes_to_muon(n, p)]
        decayed = [p for n, p in named if not gpt_parity.reference_routes_to_muon(n, p)]
        undecayed = [p for p in decayed if p.ndim < 2]
        decayed = [p for p in decayed if p.ndim >= 2]
        soap = SOAP(
            matrices,
            lr=gpt_parity.LR,
            betas=gpt_parity.BETAS,
            shampoo_beta=SHAMPOO_BETA,
            weight_decay=gpt_parity.WEIGHT_DECAY,
            use_kl_shampoo=True,
        )
        adamw = torch.optim.AdamW(
            [
                {"params": decayed, "weight_decay": gpt_parity.WEIGHT_DECAY},
                {"params": undecayed, "weight_decay": 0.0},
            ],
            lr=gpt_parity.LR,
            betas=gpt_parity.BETAS,
            eps=gpt_parity.EPS,
        )
        self.optimizers: list[torch.optim.Optimizer] = [soap, adamw]

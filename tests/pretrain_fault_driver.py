"""Test driver: ``python -m megatron_muon.pretrain`` with a NaN injected into one rank's backward.

``MEGATRON_MUON_NAN_BACKWARD=<rank>:<iteration>`` in the environment: during that training
iteration (1-based), that rank's forward output gets a gradient hook that turns the gradient
flowing back from the loss into NaN, so that rank's backward yields NaN gradients while the loss
it reports stays finite. The remaining arguments are the entry point's.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import megatron_muon.pretrain as pretrain

FAULT_VARIABLE = "MEGATRON_MUON_NAN_BACKWARD"


def main() -> None:
    rank, iteration = (int(part) for part in os.environ[FAULT_VARIABLE].split(":"))
    forward_step = pretrain.forward_step

    def forward_step_with_fault(data_iterator: Any, model: Any) -> tuple:
        from megatron.training import get_args

        output, loss_func = forward_step(data_iterator, model)
        if (
            torch.distributed.get_rank() == rank
            and get_args().curr_iteration + 1 == iteration
            and output.requires_grad  # not in evaluation
        ):
            output.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        return output, loss_func

    pretrain.forward_step = forward_step_with_fault
    pretrain.main()


if __name__ == "__main__":
    main()

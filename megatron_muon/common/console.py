"""What megatron-muon tells the user, printed the way Megatron-LM prints its own build lines.

Megatron-LM's training reports what it built ("> building train, validation, and test datasets
...", " > number of parameters on ...") with ``megatron.training.utils.print_rank_0``: a plain
``print(message, flush=True)`` on global rank 0, whatever the logging level. megatron-core's own
``log_single_rank(logger, logging.INFO, ...)`` lines are not shown by default: importing
megatron-core leaves the root logger at WARNING (and ``--logging-level`` is unset by default), so
an INFO line about which optimizer took which weights never reaches the user.

``print_rank_0`` here is that same convention without importing ``megatron.training`` (a custom
trainer on megatron-core alone should not import Megatron-LM's training loop to print a line).
"""

from __future__ import annotations

import os

import torch.distributed as dist

__all__ = ["print_rank_0"]


def print_rank_0(message: str) -> None:
    """Prints ``message`` (flushed) on global rank 0 only; before ``init_process_group``, on the
    process whose ``RANK`` environment variable is 0 or unset (as Megatron-LM's does)."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(message, flush=True)

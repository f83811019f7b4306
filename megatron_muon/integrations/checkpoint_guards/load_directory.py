"""The checkpoint Megatron-LM's ``--load`` reads: its ``iter_XXXXXXX`` directory.

Read by the load checks of ``checkpoint_guards.vocab`` (applied by ``megatron_lm.install()``) and
``checkpoint_guards.adam_state`` (the entry point's), before Megatron's ``load_checkpoint`` runs.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["checkpoint_directory"]


def checkpoint_directory(args: Any) -> str | None:
    """The ``iter_XXXXXXX`` directory Megatron's ``load_checkpoint`` will read, or None."""
    from megatron.training.checkpointing import (
        get_checkpoint_name,
        get_checkpoint_tracker_filename,
    )

    load = getattr(args, "load", None)
    if not load:
        return None
    if getattr(args, "ckpt_step", None) is not None:
        return get_checkpoint_name(load, args.ckpt_step, return_base_dir=True)
    tracker = get_checkpoint_tracker_filename(load)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    if text == "release":
        return get_checkpoint_name(load, 0, release=True, return_base_dir=True)
    return get_checkpoint_name(load, int(text), return_base_dir=True) if text.isdigit() else None

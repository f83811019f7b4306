"""The directories Megatron-LM's loads read, resolved as megatron-core 0.19.2 resolves them.

- ``checkpoint_directory(args)``: the ``iter_XXXXXXX`` directory of ``--load`` (the load checks
  of ``checkpoint_guards.integrity``, ``vocab``, ``optimizer_kind`` and the entry point's
  ``adam_state`` compare it with this run);
- ``megatron_load_dir(args, load_arg, pretrained_fallback)``: the directory whose tracker a load
  reads: ``load_checkpoint`` falls back to ``--pretrained-checkpoint`` when ``--load`` has no
  tracker (a fine-tuning run, the RL reference model's load with ``args.load = None``);
  ``load_args_from_checkpoint`` (``--use-checkpoint-args``) reads the one it is given;
- ``iteration_directory(load_dir, args)``: the directory ``_load_base_checkpoint`` reads in it.

``--ckpt-step`` is read as Megatron reads it: ``if getattr(args, 'ckpt_step', None)``, so
``--ckpt-step 0`` means "not given" and the tracker names the iteration (up to 0.2.0 the checks
tested ``is not None`` and looked at ``iter_0000000``, a directory Megatron never reads).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "checkpoint_directory",
    "iteration_directory",
    "megatron_load_dir",
    "tracker_iteration",
]


def tracker_iteration(load_dir: str) -> tuple[int, bool] | None:
    """(iteration, release) the tracker of ``load_dir`` names, as Megatron's ``read_metadata``
    reads it; (-1, False) without a tracker; None for a tracker Megatron refuses (it exits)."""
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        return -1, False
    with open(tracker) as handle:
        text = handle.read().strip()
    try:
        return int(text), False
    except ValueError:
        return (0, True) if text == "release" else None


def iteration_directory(load_dir: str | None, args: Any) -> str | None:
    """The ``iter_XXXXXXX`` (or ``release``) directory ``_load_base_checkpoint`` reads in
    ``load_dir``: the tracker's iteration, or a truthy ``args.ckpt_step``; None where it loads
    nothing or stops before reading (no iteration, a tracker it refuses)."""
    from megatron.training.checkpointing import get_checkpoint_name

    iteration, release = -1, False
    if load_dir is not None:
        named = tracker_iteration(load_dir)
        if named is None:
            return None
        iteration, release = named
    if getattr(args, "ckpt_step", None):
        iteration = args.ckpt_step
    if iteration == -1 or load_dir is None:
        return None
    return str(get_checkpoint_name(load_dir, iteration, release, return_base_dir=True))


def megatron_load_dir(args: Any, load_arg: str = "load", pretrained_fallback: bool = True) -> Any:
    """The directory a Megatron load reads the tracker of: ``getattr(args, load_arg)``, or
    (``pretrained_fallback``: ``load_checkpoint``) ``--pretrained-checkpoint`` when that has no
    tracker; None where Megatron reads nothing or raises first (no tracker in either)."""
    from megatron.training.checkpointing import checkpoint_exists

    load_dir = getattr(args, load_arg, None)
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained_fallback and pretrained is not None and not checkpoint_exists(load_dir):
        return pretrained if checkpoint_exists(pretrained) else None
    return load_dir


def checkpoint_directory(args: Any) -> str | None:
    """The ``iter_XXXXXXX`` directory Megatron's ``load_checkpoint`` will read in ``--load``, or
    None (no ``--load``, no checkpoint named there)."""
    load = getattr(args, "load", None)
    return iteration_directory(load, args) if load else None

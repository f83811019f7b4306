"""Each rank's random number generator states, captured at a save and restored at a load.

Saved per rank (``common.rng.rank<r>``) and restored only when the world size is unchanged:
elsewhere there is no rank-to-rank correspondence. With them a resumed run draws what the
uninterrupted run drew (dropout masks, noise), so resume is exact.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["capture_rng", "restore_rng"]


def _rng_tracker() -> Any:
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except ImportError:  # pragma: no cover
        return None
    tracker = get_cuda_rng_tracker()
    return tracker if tracker.is_initialized() else None


def capture_rng() -> dict[str, Any]:
    """This rank's RNG states: Python, NumPy, torch CPU, CUDA (if in use), Megatron's tracker."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = _rng_tracker()
    if tracker is not None:
        state["megatron_tracker"] = tracker.get_states()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Sets this rank's RNGs to ``state`` (``capture_rng``'s; parts absent here are skipped)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = _rng_tracker()
    if "megatron_tracker" in state and tracker is not None:
        tracker.set_states(state["megatron_tracker"])

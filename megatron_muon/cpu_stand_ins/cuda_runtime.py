"""CPU stand-ins for ``torch.cuda``'s runtime: device query, streams, RNG state."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from megatron_muon.cpu_stand_ins._replace import set_stand_in

__all__ = ["patch"]


class _NoOpEvent:
    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoOpStream:
    """Stands in for ``torch.cuda.Stream``: CPU ops are already ordered."""

    device = torch.device("cpu")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _NoOpEvent:
        return _NoOpEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _NoOpStream()


def patch() -> None:
    """``torch.cuda``'s device query, streams, record_stream and RNG state on CPU."""
    set_stand_in(torch.cuda, "current_device", lambda: 0)
    set_stand_in(torch.cuda, "Stream", _NoOpStream)
    set_stand_in(torch.cuda, "current_stream", lambda *a, **k: _DEFAULT_STREAM)
    set_stand_in(torch.cuda, "default_stream", lambda *a, **k: _DEFAULT_STREAM)
    set_stand_in(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    # Record-stream bookkeeping on CPU tensors has nothing to record.
    set_stand_in(torch.Tensor, "record_stream", lambda self, stream: None)
    # There is no CUDA generator: the CPU generator stands in (TP RNG sync, checkpoints).
    set_stand_in(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    set_stand_in(torch.cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))

"""Momentum offload: Muon's momentum in host memory between steps, bitwise unchanged.

After a step, ``offload`` copies each momentum buffer's local rows to host memory (pinned on GPU
machines) and frees the device storage; ``bring_back`` restores it before anything reads or writes
it. The tensor objects themselves stay where they are (the optimizer's ``state``), so checkpoint
keys, DTensor placements and global shapes never change: only their storage is released.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["MomentumOffload"]


class MomentumOffload:
    """Host copies of offloaded momentum buffers (local tensors, not DTensors), kept between
    steps so that each is allocated once."""

    def __init__(self) -> None:
        self._host: dict[torch.Tensor, torch.Tensor] = {}

    def offload(self, buffers: Iterable[torch.Tensor]) -> None:
        """Copies each buffer to host memory and frees its device storage."""
        pin = torch.cuda.is_available()
        for local in buffers:
            host = self._host.get(local)
            if host is None:
                host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
                self._host[local] = host
            host.copy_(local, non_blocking=pin)
        if pin:
            torch.cuda.current_stream().synchronize()
        for local in self._host:
            local.untyped_storage().resize_(0)

    def bring_back(self) -> None:
        """Restores every offloaded buffer's storage and values (a no-op when none is offloaded)."""
        for local, host in self._host.items():
            storage = local.untyped_storage()
            if storage.size() == 0:
                storage.resize_(host.numel() * host.element_size())
                local.copy_(host, non_blocking=True)

    def forget(self) -> None:
        """Drops the host copies: the buffers were replaced (a state dict was loaded)."""
        self._host.clear()

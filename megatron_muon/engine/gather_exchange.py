"""The reference exchange: every matrix's row shards gathered on every rank (``mode="gather"``).

One padded ``all_gather`` per bucket over the data-parallel group, entered by every rank; each rank
then assembles every full matrix and orthogonalizes all of them (what Megatron-LM does for the
params a rank holds only part of). Inputs and outputs are plain local tensors
(``(rows, *row_shape)``, fp32). The owner exchange (``exchange``) moves about DP times fewer bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_muon.engine.exchange import COLLECTIVE_SCOPE, ExchangeStats
from megatron_muon.engine.layout import RowLayout, all_gather_single

__all__ = ["GatherExchange"]


class GatherExchange:
    """Padded all_gather of every matrix's row shards to every rank, for one bucket (reference).

    Args:
        layouts: row layout of each matrix in the bucket (same on every rank).
        rank: this rank in ``group``.
        group: the data-parallel process group.
        device: where buffers are allocated (the params' device).
    """

    def __init__(
        self,
        layouts: Sequence[RowLayout],
        rank: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.device = device
        self.layouts = list(layouts)
        self.rank = rank
        self.group = group
        self.world = dist.get_world_size(group)
        self.max_rows = [
            max(layout.rows_of(r) for r in range(self.world)) for layout in self.layouts
        ]
        self.slot_numel = [
            rows * layout.row_numel
            for rows, layout in zip(self.max_rows, self.layouts, strict=True)
        ]

    def gather(
        self, local_rows: Sequence[torch.Tensor], stats: ExchangeStats
    ) -> list[torch.Tensor]:
        """Every full matrix on every rank. Collective over ``group``.

        Args:
            local_rows: this rank's rows of each matrix, ``(rows_of(rank), *row_shape)``.

        Returns:
            Each full matrix ``(num_rows, *row_shape)``, fp32.
        """
        slot_total = sum(self.slot_numel)
        packed = torch.zeros(slot_total, dtype=torch.float32, device=self.device)
        position = 0
        for rows, slot in zip(local_rows, self.slot_numel, strict=True):
            flat = rows.reshape(-1)
            packed[position : position + flat.numel()].copy_(flat)
            position += slot
        gathered = torch.empty(self.world * slot_total, dtype=torch.float32, device=self.device)
        with torch.profiler.record_function(COLLECTIVE_SCOPE):
            all_gather_single(gathered, packed, group=self.group)
        gathered = gathered.view(self.world, slot_total)
        stats.num_collectives += 1
        stats.bytes_sent += 4 * slot_total * (self.world - 1)
        stats.bytes_received += 4 * slot_total * (self.world - 1)

        full = []
        offsets = [0]
        for slot in self.slot_numel:
            offsets.append(offsets[-1] + slot)
        for m, layout in enumerate(self.layouts):
            matrix = torch.empty(layout.shape, dtype=torch.float32, device=self.device)
            for (start, stop), holders in layout.intervals():
                numel = (stop - start) * layout.row_numel
                data = gathered[holders[0], offsets[m] : offsets[m] + numel]
                matrix[start:stop].copy_(data.view(stop - start, *layout.row_shape))
            full.append(matrix)
        return full

    def local_rows_of(self, full: torch.Tensor, m: int) -> torch.Tensor:
        """This rank's rows of a full matrix of bucket position ``m``."""
        start, stop = self.layouts[m].ranges[self.rank]
        return full[start:stop]

"""Moving row shards to where Newton-Schulz runs, and the results back.

Two exchanges over the data-parallel group, both exact and both entered by every rank for every
matrix of a bucket, whether it holds rows of it or not (a rank that skipped one would desynchronise
the collective):

- ``OwnerExchange`` (owner-compute): each matrix has one owner rank. One packed ``all_to_all``
  brings every row shard to its matrix's owner; after NS, one packed ``all_to_all`` returns each
  holder its rows. A rank sends about its own shard bytes each way, not ``DP x``.
- ``GatherExchange`` (reference): one padded ``all_gather`` brings every matrix to every rank.

Split sizes and pack/unpack maps depend only on the layouts and the plan, so they are computed once
per bucket and kept. Inputs and outputs are plain local tensors (``(rows, *row_shape)``, fp32).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_muon.layout import RowLayout, all_gather_single

__all__ = [
    "ExchangeStats",
    "GatherExchange",
    "OwnerExchange",
    "PendingExchange",
    "source_rank",
]


@dataclass(slots=True)
class ExchangeStats:
    """Bytes this rank sent to / received from other ranks, and collectives it entered."""

    bytes_sent: int = 0
    bytes_received: int = 0
    num_collectives: int = 0

    def add(self, other: ExchangeStats) -> None:
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.num_collectives += other.num_collectives


def source_rank(holders: Sequence[int], owner: int, matrix_index: int) -> int:
    """Which holder of a row interval sends it to the owner: the owner itself if it holds it
    (no traffic), else one holder chosen by matrix index to spread replicas' send load."""
    if owner in holders:
        return owner
    return holders[matrix_index % len(holders)]


@dataclass(slots=True)
class _Block:
    """A run of rows of one matrix inside a packed buffer."""

    matrix: int  # index into the bucket's matrix list
    start: int  # first row
    stop: int  # one past the last row


@dataclass(slots=True)
class PendingExchange:
    """An all_to_all in flight: its handle, its buffers (kept alive) and how to unpack it."""

    work: Any
    send_buffer: torch.Tensor
    recv_buffer: torch.Tensor
    recv: _Splits
    write: Callable[[_Block, torch.Tensor], None]
    output: Any


@dataclass(slots=True)
class _Splits:
    """Per-peer block lists and element counts of one all_to_all, for this rank."""

    blocks: list[list[_Block]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


class OwnerExchange:
    """Packed all_to_all of row shards to owners and of results back, for one bucket of matrices.

    Args:
        layouts: row layout of each matrix in the bucket (same on every rank).
        owners: owner group rank of each matrix.
        matrix_ids: global matrix index of each (seeds the choice among replicas).
        rank: this rank in ``group``.
        group: the data-parallel process group.
        device: where buffers are allocated (the params' device).
    """

    def __init__(
        self,
        layouts: Sequence[RowLayout],
        owners: Sequence[int],
        matrix_ids: Sequence[int],
        rank: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.device = device
        self.layouts = list(layouts)
        self.owners = list(owners)
        self.rank = rank
        self.group = group
        world = dist.get_world_size(group)
        self.to_owner_send = _Splits([[] for _ in range(world)], [0] * world)
        self.to_owner_recv = _Splits([[] for _ in range(world)], [0] * world)
        self.back_send = _Splits([[] for _ in range(world)], [0] * world)
        self.back_recv = _Splits([[] for _ in range(world)], [0] * world)
        for m, (layout, owner, matrix_id) in enumerate(
            zip(self.layouts, self.owners, matrix_ids, strict=True)
        ):
            for (start, stop), holders in layout.intervals():
                source = source_rank(holders, owner, matrix_id)
                numel = (stop - start) * layout.row_numel
                if source == rank:
                    self.to_owner_send.blocks[owner].append(_Block(m, start, stop))
                    self.to_owner_send.sizes[owner] += numel
                if owner == rank:
                    self.to_owner_recv.blocks[source].append(_Block(m, start, stop))
                    self.to_owner_recv.sizes[source] += numel
                for holder in holders:
                    if owner == rank:
                        self.back_send.blocks[holder].append(_Block(m, start, stop))
                        self.back_send.sizes[holder] += numel
                    if holder == rank:
                        self.back_recv.blocks[owner].append(_Block(m, start, stop))
                        self.back_recv.sizes[owner] += numel

    def owned(self) -> list[int]:
        """Bucket positions of the matrices this rank owns."""
        return [m for m, owner in enumerate(self.owners) if owner == self.rank]

    def gather_to_owners(
        self, local_rows: Sequence[torch.Tensor], stats: ExchangeStats
    ) -> dict[int, torch.Tensor]:
        """Sends each local row shard to its matrix's owner. Collective over ``group``.

        Args:
            local_rows: this rank's rows of each matrix, ``(rows_of(rank), *row_shape)``.

        Returns:
            For each owned bucket position, the full matrix ``(num_rows, *row_shape)``, fp32.
        """
        return self.finish(self.start_gather_to_owners(local_rows, stats))

    def start_gather_to_owners(
        self, local_rows: Sequence[torch.Tensor], stats: ExchangeStats
    ) -> PendingExchange:
        """Starts ``gather_to_owners`` asynchronously; ``finish`` returns its result."""
        full = {
            m: torch.empty(self.layouts[m].shape, dtype=torch.float32, device=self.device)
            for m in self.owned()
        }

        def read(block: _Block) -> torch.Tensor:
            start = self.layouts[block.matrix].ranges[self.rank][0]
            return local_rows[block.matrix][block.start - start : block.stop - start]

        def write(block: _Block, data: torch.Tensor) -> None:
            full[block.matrix][block.start : block.stop].copy_(data)

        return self._start(self.to_owner_send, self.to_owner_recv, read, write, full, stats)

    def scatter_from_owners(
        self, results: dict[int, torch.Tensor], stats: ExchangeStats
    ) -> list[torch.Tensor]:
        """Returns each holder its rows of the owners' results. Collective over ``group``.

        Args:
            results: for each owned bucket position, the full result ``(num_rows, *row_shape)``.

        Returns:
            This rank's rows of each matrix's result, ``(rows_of(rank), *row_shape)``, fp32.
        """
        return self.finish(self.start_scatter_from_owners(results, stats))

    def start_scatter_from_owners(
        self, results: dict[int, torch.Tensor], stats: ExchangeStats
    ) -> PendingExchange:
        """Starts ``scatter_from_owners`` asynchronously; ``finish`` returns its result."""
        mine = [
            torch.empty(
                (layout.rows_of(self.rank), *layout.row_shape),
                dtype=torch.float32,
                device=self.device,
            )
            for layout in self.layouts
        ]

        def read(block: _Block) -> torch.Tensor:
            return results[block.matrix][block.start : block.stop]

        def write(block: _Block, data: torch.Tensor) -> None:
            start = self.layouts[block.matrix].ranges[self.rank][0]
            mine[block.matrix][block.start - start : block.stop - start].copy_(data)

        return self._start(self.back_send, self.back_recv, read, write, mine, stats)

    def _start(self, send: _Splits, recv: _Splits, read, write, output, stats) -> PendingExchange:
        """Packs the send buffer and launches the all_to_all without waiting for it."""
        pieces = [read(b).reshape(-1).float() for peer in send.blocks for b in peer]
        send_buffer = (
            torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float32, device=self.device)
        )
        recv_buffer = torch.empty(sum(recv.sizes), dtype=torch.float32, device=self.device)
        work = dist.all_to_all_single(
            recv_buffer, send_buffer, recv.sizes, send.sizes, group=self.group, async_op=True
        )
        stats.num_collectives += 1
        stats.bytes_sent += 4 * (sum(send.sizes) - send.sizes[self.rank])
        stats.bytes_received += 4 * (sum(recv.sizes) - recv.sizes[self.rank])
        return PendingExchange(work, send_buffer, recv_buffer, recv, write, output)

    def finish(self, pending: PendingExchange) -> Any:
        """Waits for a started exchange and unpacks what arrived into its output."""
        pending.work.wait()
        position = 0
        for peer_blocks in pending.recv.blocks:
            for block in peer_blocks:
                layout = self.layouts[block.matrix]
                numel = (block.stop - block.start) * layout.row_numel
                data = pending.recv_buffer[position : position + numel]
                pending.write(block, data.view(block.stop - block.start, *layout.row_shape))
                position += numel
        return pending.output


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

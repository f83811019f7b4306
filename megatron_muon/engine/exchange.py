"""Moving row shards to where Newton-Schulz runs, and the results back.

Two exchanges over the data-parallel group, both exact and both entered by every rank for every
matrix of a bucket, whether it holds rows of it or not (a rank that skipped one would desynchronise
the collective):

- ``OwnerExchange`` (owner-compute): each matrix has one owner rank. Every row shard travels to its
  matrix's owner by point-to-point messages (one batch per bucket), straight from the rows it is
  sent from into the full matrix it is received into; after NS, each holder gets its rows of the
  result the same way. A rank sends about its own shard bytes each way, not ``DP x``.
- ``GatherExchange`` (reference, ``gather_exchange``): one padded ``all_gather`` brings every
  matrix to every rank.

No packed copy on either side where a view does: a block of whole rows is a contiguous view of
the rows it is sent from and of the matrix it is received into. Only a block cut by columns (a
matrix whose NS is split over ranks along its columns) is staged in a contiguous buffer, where it
is not contiguous. Who sends which block to whom depends only on the layouts and the plan, so it is
computed once per bucket and kept. Inputs and outputs are plain local tensors
(``(rows, *row_shape)``, fp32). Time spent waiting for the exchanges and collectives is inside the
profiler scope ``COLLECTIVE_SCOPE``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_muon.engine.layout import RowLayout
from megatron_muon.engine.step_plan import WorkBlock

__all__ = [
    "COLLECTIVE_SCOPE",
    "ExchangeStats",
    "OwnerExchange",
    "PendingExchange",
    "source_rank",
]


# Profiler scope (``torch.profiler.record_function``) of the time spent in the optimizer's
# collectives and in waiting for its exchanges: transfer, and waiting for the other ranks.
COLLECTIVE_SCOPE = "megatron_muon.collectives"


@dataclass(slots=True)
class ExchangeStats:
    """Bytes this rank sent to / received from other ranks, and collectives it entered."""

    bytes_sent: int = 0
    bytes_received: int = 0
    num_collectives: int = 0


def source_rank(holders: Sequence[int], owner: int, matrix_index: int) -> int:
    """Which holder of a row interval sends it to a worker: the worker itself if it holds it
    (no traffic), else one holder chosen by matrix index to spread replicas' send load."""
    if owner in holders:
        return owner
    return holders[matrix_index % len(holders)]


@dataclass(slots=True)
class _Block:
    """A rectangle of one matrix that travels as one message: rows x columns of work block
    ``work``."""

    matrix: int  # index into the bucket's matrix list
    work: int  # index into that matrix's work blocks
    start: int  # first row
    stop: int  # one past the last row
    col_start: int
    col_stop: int


@dataclass(slots=True)
class _Splits:
    """Per-peer block lists and element counts of one direction of an exchange, for this rank."""

    blocks: list[list[_Block]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


@dataclass(slots=True)
class PendingExchange:
    """Point-to-point messages in flight, and what ``OwnerExchange.finish`` does once they land.

    Attributes:
        works: the handles of this rank's sends and receives.
        staged: ``(buffer, destination)`` of each receive that could not land in place (its
            destination is not contiguous); copied after the wait.
        keep: send buffers staged because their source was not contiguous fp32 (kept alive
            until the sends are done).
        output: what ``finish`` returns.
    """

    works: list[Any]
    staged: list[tuple[torch.Tensor, torch.Tensor]]
    keep: list[torch.Tensor]
    output: Any


class OwnerExchange:
    """Point-to-point exchange of row shards to workers and of results back, for one bucket.

    Args:
        layouts: row layout of each matrix in the bucket (same on every rank).
        work: each matrix's work blocks (``WorkBlock.whole(owner, layout)`` for one owner).
        matrix_ids: global matrix index of each (seeds the choice among replicas).
        rank: this rank in ``group``.
        group: the data-parallel process group.
        device: where buffers are allocated (the params' device).
    """

    def __init__(
        self,
        layouts: Sequence[RowLayout],
        work: Sequence[Sequence[WorkBlock]],
        matrix_ids: Sequence[int],
        rank: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.device = device
        self.layouts = list(layouts)
        self.work = [list(blocks) for blocks in work]
        self.rank = rank
        self.group = group
        world = dist.get_world_size(group)
        self.to_owner_send = _Splits([[] for _ in range(world)], [0] * world)
        self.to_owner_recv = _Splits([[] for _ in range(world)], [0] * world)
        self.back_send = _Splits([[] for _ in range(world)], [0] * world)
        self.back_recv = _Splits([[] for _ in range(world)], [0] * world)
        for m, (layout, blocks, matrix_id) in enumerate(
            zip(self.layouts, self.work, matrix_ids, strict=True)
        ):
            for (start, stop), holders in layout.intervals():
                for k, w in enumerate(blocks):
                    rows = (max(start, w.row_start), min(stop, w.row_stop))
                    if rows[0] >= rows[1]:
                        continue
                    block = _Block(m, k, rows[0], rows[1], w.col_start, w.col_stop)
                    numel = self._numel(block)
                    source = source_rank(holders, w.rank, matrix_id)
                    if source == rank:
                        self.to_owner_send.blocks[w.rank].append(block)
                        self.to_owner_send.sizes[w.rank] += numel
                    if w.rank == rank:
                        self.to_owner_recv.blocks[source].append(block)
                        self.to_owner_recv.sizes[source] += numel
                    for holder in holders:
                        if w.rank == rank:
                            self.back_send.blocks[holder].append(block)
                            self.back_send.sizes[holder] += numel
                        if holder == rank:
                            self.back_recv.blocks[w.rank].append(block)
                            self.back_recv.sizes[w.rank] += numel
        # Blocks a rank would send to itself are not sent: they are copied
        # locally, or, where one such block is a whole work block (or all of this rank's rows of a
        # result), used in place with no copy at all.
        self._self_in = self._take_self_blocks(self.to_owner_send, self.to_owner_recv)
        self._self_back = self._take_self_blocks(self.back_send, self.back_recv)
        self._direct_in = self._direct_work_keys()
        self._direct_back = self._direct_result_matrices()

    def _take_self_blocks(self, send: _Splits, recv: _Splits) -> list[_Block]:
        blocks = send.blocks[self.rank]
        assert blocks == recv.blocks[self.rank]
        send.blocks[self.rank], recv.blocks[self.rank] = [], []
        send.sizes[self.rank] = recv.sizes[self.rank] = 0
        return blocks

    def _direct_work_keys(self) -> dict[tuple[int, int], _Block]:
        """Work blocks filled by exactly one local block spanning them: used as views."""
        remote = {(b.matrix, b.work) for peer in self.to_owner_recv.blocks for b in peer}
        count: dict[tuple[int, int], list[_Block]] = {}
        for block in self._self_in:
            count.setdefault((block.matrix, block.work), []).append(block)
        direct = {}
        for key, blocks in count.items():
            w = self.work[key[0]][key[1]]
            b = blocks[0]
            if (
                key not in remote
                and len(blocks) == 1
                and (b.start, b.stop)
                == (
                    w.row_start,
                    w.row_stop,
                )
            ):
                direct[key] = b
        return direct

    def _direct_result_matrices(self) -> dict[int, _Block]:
        """Matrices whose result rows this rank computed itself in one block: used as views."""
        remote = {b.matrix for peer in self.back_recv.blocks for b in peer}
        count: dict[int, list[_Block]] = {}
        for block in self._self_back:
            count.setdefault(block.matrix, []).append(block)
        direct = {}
        for m, blocks in count.items():
            b = blocks[0]
            start, stop = self.layouts[m].ranges[self.rank]
            full_cols = (b.col_start, b.col_stop) == (0, self.layouts[m].row_shape[0])
            if m not in remote and len(blocks) == 1 and (b.start, b.stop) == (start, stop):
                if full_cols:
                    direct[m] = b
        return direct

    def _numel(self, block: _Block) -> int:
        row_shape = self.layouts[block.matrix].row_shape
        inner = 1
        for size in row_shape[1:]:
            inner *= size
        return (block.stop - block.start) * (block.col_stop - block.col_start) * inner

    def owned(self) -> list[tuple[int, int]]:
        """``(bucket position, work block index)`` of the blocks this rank computes on."""
        return [
            (m, k)
            for m, blocks in enumerate(self.work)
            for k, w in enumerate(blocks)
            if w.rank == self.rank
        ]

    def _work_shape(self, m: int, k: int) -> tuple[int, ...]:
        w = self.work[m][k]
        return (w.row_stop - w.row_start, w.col_stop - w.col_start, *self.layouts[m].row_shape[1:])

    def start_gather_to_owners(
        self, local_rows: Sequence[torch.Tensor], stats: ExchangeStats
    ) -> PendingExchange:
        """Starts sending each local row shard to the workers of its matrix (collective over
        ``group``, asynchronous); ``finish`` waits and returns the result.

        Args:
            local_rows: this rank's rows of each matrix, ``(rows_of(rank), *row_shape)``.

        Returns:
            The pending exchange; ``finish`` gives, for each of this rank's work blocks
            ``(m, k)``, its rectangle of matrix ``m`` (the full matrix for an unsplit one), fp32.
        """

        def read(block: _Block) -> torch.Tensor:
            start = self.layouts[block.matrix].ranges[self.rank][0]
            rows = local_rows[block.matrix][block.start - start : block.stop - start]
            return rows[:, block.col_start : block.col_stop]

        full = {
            key: (
                read(self._direct_in[key]).float()
                if key in self._direct_in
                else torch.empty(self._work_shape(*key), dtype=torch.float32, device=self.device)
            )
            for key in self.owned()
        }

        def target(block: _Block) -> torch.Tensor:
            w = self.work[block.matrix][block.work]
            return full[(block.matrix, block.work)][
                block.start - w.row_start : block.stop - w.row_start
            ]

        local = [b for b in self._self_in if (b.matrix, b.work) not in self._direct_in]
        return self._start(self.to_owner_send, self.to_owner_recv, read, target, full, stats, local)

    def start_scatter_from_owners(
        self, results: dict[tuple[int, int], torch.Tensor], stats: ExchangeStats
    ) -> PendingExchange:
        """Starts returning each holder its rows of the workers' results (collective over
        ``group``, asynchronous); ``finish`` waits and returns the result.

        Args:
            results: for each of this rank's work blocks ``(m, k)``, the result rectangle;
                a result whose rows go to other ranks is replaced by a row-major copy where it is
                not row-major.

        Returns:
            The pending exchange; ``finish`` gives this rank's rows of each matrix's result,
            ``(rows_of(rank), *row_shape)``, fp32.
        """

        # NS returns a tall matrix's result transposed in memory (it iterates on the transpose):
        # its rows are sent from a row-major copy, which replaces it at once (one matrix's extra
        # memory at a time, where packing every block would hold them all).
        for key in {(b.matrix, b.work) for peer in self.back_send.blocks for b in peer}:
            results[key] = results[key].contiguous()

        def read(block: _Block) -> torch.Tensor:
            w = self.work[block.matrix][block.work]
            return results[(block.matrix, block.work)][
                block.start - w.row_start : block.stop - w.row_start
            ]

        mine = [
            read(self._direct_back[m])
            if m in self._direct_back
            else torch.empty(
                (layout.rows_of(self.rank), *layout.row_shape),
                dtype=torch.float32,
                device=self.device,
            )
            for m, layout in enumerate(self.layouts)
        ]

        def target(block: _Block) -> torch.Tensor:
            start = self.layouts[block.matrix].ranges[self.rank][0]
            rows = mine[block.matrix][block.start - start : block.stop - start]
            return rows[:, block.col_start : block.col_stop]

        local = [b for b in self._self_back if b.matrix not in self._direct_back]
        return self._start(self.back_send, self.back_recv, read, target, mine, stats, local)

    def _start(
        self,
        send: _Splits,
        recv: _Splits,
        read: Callable[[_Block], torch.Tensor],
        target: Callable[[_Block], torch.Tensor],
        output: Any,
        stats: ExchangeStats,
        local: list[_Block],
    ) -> PendingExchange:
        """Starts this rank's sends (``read(block)``, a view where contiguous) and receives
        (into ``target(block)``, in place where contiguous) without waiting for them, then copies
        the blocks this rank keeps (``local``) while they travel."""
        group_ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
        # Messages between two ranks are matched in the order they are posted, per tag; both sides
        # list a pair's blocks in the same order, and the tag numbers them within the exchange.
        ops: list[dist.P2POp] = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        keep: list[torch.Tensor] = []
        for peer, blocks in enumerate(recv.blocks):
            for tag, block in enumerate(blocks):
                destination = target(block)
                buffer = destination if destination.is_contiguous() else None
                if buffer is None:
                    buffer = torch.empty_like(destination, memory_format=torch.contiguous_format)
                    staged.append((buffer, destination))
                ops.append(dist.P2POp(dist.irecv, buffer, group_ranks[peer], self.group, tag))
        for peer, blocks in enumerate(send.blocks):
            for tag, block in enumerate(blocks):
                source = read(block)
                data = source.float().contiguous()  # the source itself where it already is
                if data.data_ptr() != source.data_ptr():
                    keep.append(data)
                ops.append(dist.P2POp(dist.isend, data, group_ranks[peer], self.group, tag))
        works = dist.batch_isend_irecv(ops) if ops else []
        for block in local:
            target(block).copy_(read(block))
        stats.num_collectives += 1
        stats.bytes_sent += 4 * sum(send.sizes)
        stats.bytes_received += 4 * sum(recv.sizes)
        return PendingExchange(works, staged, keep, output)

    def finish(self, pending: PendingExchange) -> Any:
        """Waits for a started exchange; copies the staged receives into place."""
        with torch.profiler.record_function(COLLECTIVE_SCOPE):
            for work in pending.works:
                work.wait()
        for buffer, destination in pending.staged:
            destination.copy_(buffer)
        output = pending.output
        # Drop every reference to the messages' tensors, so that each is freed with its last use.
        pending.works, pending.staged, pending.keep, pending.output = [], [], [], None
        return output

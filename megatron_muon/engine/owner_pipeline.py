"""A step's Newton-Schulz over exchange buckets: rows in, NS, results back (one rank's view).

``BucketRuntime.run`` takes the step's active 2-D matrices bucket by bucket (``StepPlan.buckets``)
through three callbacks, as torchtitan's distributed Muon runtime does:

- ``prepare(matrix)``: this rank's rows of the NS input, ``(rows_of(rank), cols)`` fp32;
- ``compute``: an ``NSRunner`` orthogonalizing what arrived on this rank (whole matrices, small
  ones batched, blocks of split matrices over their rank block's process group);
- ``finalize(matrix, rows)``: this rank's rows of the orthogonalized update.

How rows travel depends on the data-parallel group ``group`` and the mode:

- one rank: no exchange, NS on the local (full) matrices;
- ``"gather"`` (reference): a padded all_gather per bucket (``GatherExchange``), NS of every
  matrix on every rank;
- ``"owner"``: the rows travel to the owners (``OwnerExchange``, point-to-point messages straight
  into the full matrices) and the results back, one bucket after the other, so that one bucket's
  full matrices (``bucket_size_bytes``) are all that is held at once, as that bound promises: each
  input is freed as its NS finishes, each result once its rows have reached their holders. While
  the messages travel the rank copies the rows it keeps itself. With ``overlap_buckets`` the
  rows of bucket k+1 travel to their owners while bucket k runs NS (bucket k-1's results are back
  before bucket k+1's receive buffers are made), so two buckets' full matrices are held at once,
  never more; the arithmetic is the same, so the updates are bitwise those of the sequential
  pipeline.

Every rank enters every collective of every bucket, whether it holds rows of its matrices or not.
The exchanges (their pack/unpack maps) are built once per set of active matrices and kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_muon.common.options import FsdpModeT
from megatron_muon.engine.exchange import COLLECTIVE_SCOPE, OwnerExchange
from megatron_muon.engine.gather_exchange import GatherExchange
from megatron_muon.engine.layout import new_member_group
from megatron_muon.engine.ns_runner import NSRunner, StepStats
from megatron_muon.engine.step_plan import MatrixPlan, StepPlan

__all__ = ["BucketRuntime", "create_split_groups"]

PrepareT = Callable[[MatrixPlan], torch.Tensor]
FinalizeT = Callable[[MatrixPlan, torch.Tensor], None]


class BucketRuntime:
    """Runs a static plan's buckets, step after step, on one rank of ``group``.

    Args:
        plan: the static plan (same on every rank).
        mode: ``"owner"`` or ``"gather"``.
        group: the data-parallel process group (``None``: the default group).
        num_ranks: ranks in ``group`` (1: no exchange).
        overlap_buckets: owner mode: exchange bucket k+1 while bucket k runs NS (module docstring).

    Creates a process group per rank block that splits a matrix's NS and includes this rank
    (``create_split_groups``: collective over the block's ranks).
    """

    def __init__(
        self,
        plan: StepPlan,
        mode: FsdpModeT,
        group: dist.ProcessGroup | None,
        num_ranks: int,
        overlap_buckets: bool = False,
    ) -> None:
        self.plan = plan
        self.overlap_buckets = overlap_buckets
        self.mode = mode
        self.group = group
        self.num_ranks = num_ranks
        self.rank = dist.get_rank(group) if num_ranks > 1 else 0
        self.split_groups = create_split_groups(plan, group) if num_ranks > 1 else {}
        self._exchanges: dict[tuple[int, ...], OwnerExchange | GatherExchange] = {}

    def params_with_grad_anywhere(
        self, params: Sequence[torch.Tensor], stats: StepStats
    ) -> list[bool]:
        """Which of ``params`` have a grad on some rank of ``group`` (one small all_reduce).

        A rank holding zero rows has ``grad is None`` yet must take part; a param with no grad on
        any rank is skipped everywhere, as ``TensorParallelMuon`` skips it.
        """
        flags = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        if self.num_ranks > 1:
            with torch.profiler.record_function(COLLECTIVE_SCOPE):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            stats.num_collectives += 1
        return [bool(f) for f in flags.tolist()]

    def run(
        self,
        active: Sequence[bool],
        prepare: PrepareT,
        compute: NSRunner,
        finalize: FinalizeT,
        stats: StepStats,
    ) -> None:
        """One step over the buckets' matrices with ``active[m]`` (a grad on some rank).

        Collective over ``group`` (and the split blocks' groups).
        """
        buckets = [tuple(m for m in bucket if active[m]) for bucket in self.plan.buckets]
        buckets = [bucket for bucket in buckets if bucket]
        rows = [[prepare(self.plan.matrices[m]) for m in bucket] for bucket in buckets]
        if self.num_ranks == 1:
            # Every row is here: NS on the local matrices, each update applied as soon as its NS
            # is done (one result alive at a time, as TensorParallelMuon steps).
            for bucket, local in zip(buckets, rows, strict=True):
                stats.note_held(local)
                plans = self._plans(bucket)
                for i, result in compute.each_whole(plans, list[torch.Tensor | None](local)):
                    finalize(plans[i], result)
        elif self.mode == "gather":
            for bucket, local in zip(buckets, rows, strict=True):
                self._gather(bucket, local, compute, finalize, stats)
        elif self.overlap_buckets:
            self._owner_pipeline_overlapped(buckets, rows, compute, finalize, stats)
        else:
            self._owner_pipeline(buckets, rows, compute, finalize, stats)

    def _plans(self, bucket: Sequence[int]) -> list[MatrixPlan]:
        return [self.plan.matrices[m] for m in bucket]

    def _finalize(
        self, bucket: Sequence[int], results: Sequence[torch.Tensor], finalize: FinalizeT
    ) -> None:
        for plan, result in zip(self._plans(bucket), results, strict=True):
            finalize(plan, result)

    def _gather(self, bucket, local, compute: NSRunner, finalize: FinalizeT, stats) -> None:
        exchange = self._exchanges.get(bucket)
        if exchange is None:
            layouts = [plan.matrix.layout for plan in self._plans(bucket)]
            exchange = GatherExchange(layouts, self.rank, self.group, local[0].device)
            self._exchanges[bucket] = exchange
        assert isinstance(exchange, GatherExchange)
        full = exchange.gather(local, stats)
        stats.note_held(full)
        results = compute.whole(self._plans(bucket), list[torch.Tensor | None](full))
        mine = [exchange.local_rows_of(r, m).clone() for m, r in enumerate(results)]
        self._finalize(bucket, mine, finalize)

    def _owner_exchange(self, bucket: tuple[int, ...], device: torch.device) -> OwnerExchange:
        exchange = self._exchanges.get(bucket)
        if exchange is None:
            plans = self._plans(bucket)
            exchange = OwnerExchange(
                [plan.matrix.layout for plan in plans],
                [plan.work for plan in plans],
                list(bucket),
                self.rank,
                self.group,
                device,
            )
            self._exchanges[bucket] = exchange
        assert isinstance(exchange, OwnerExchange)
        return exchange

    def _owner_pipeline(self, buckets, rows, compute: NSRunner, finalize, stats) -> None:
        """Owner-compute, one bucket after the other (module docstring): its rows to the owners,
        NS, its results back, its updates applied; then the next bucket."""
        for bucket, local in zip(buckets, rows, strict=True):
            exchange = self._owner_exchange(bucket, local[0].device)
            blocks = exchange.finish(exchange.start_gather_to_owners(local, stats))
            stats.note_held(list(blocks.values()))
            results = self._compute_blocks(self._plans(bucket), blocks, compute)
            returning = exchange.start_scatter_from_owners(results, stats)
            del blocks, results  # each freed once its messages are done
            self._finalize(bucket, exchange.finish(returning), finalize)

    def _owner_pipeline_overlapped(self, buckets, rows, compute: NSRunner, finalize, stats) -> None:
        """Owner-compute with the next bucket's rows in flight during this bucket's NS: finish
        bucket k's rows in, finish bucket k-1's results back (and apply them), start bucket k+1's
        rows in, NS of bucket k, start its results back. At most two buckets' full matrices are
        alive at once (k's and k+1's receive buffers)."""
        device = rows[0][0].device
        exchanges = [self._owner_exchange(bucket, device) for bucket in buckets]
        incoming = exchanges[0].start_gather_to_owners(rows[0], stats)
        returning = None
        for k, bucket in enumerate(buckets):
            blocks = exchanges[k].finish(incoming)
            if returning is not None:
                self._finalize(buckets[k - 1], exchanges[k - 1].finish(returning), finalize)
                returning = None
            held = list(blocks.values())
            if k + 1 < len(buckets):
                incoming = exchanges[k + 1].start_gather_to_owners(rows[k + 1], stats)
                held += list(incoming.output.values())  # the next bucket's receive buffers
            stats.note_held(held)
            results = self._compute_blocks(self._plans(bucket), blocks, compute)
            returning = exchanges[k].start_scatter_from_owners(results, stats)
            del blocks, results  # each freed once its messages are done
        assert returning is not None  # run() passes non-empty buckets only
        self._finalize(buckets[-1], exchanges[-1].finish(returning), finalize)

    def _compute_blocks(
        self,
        plans: Sequence[MatrixPlan],
        blocks: dict[tuple[int, int], torch.Tensor],
        compute: NSRunner,
    ) -> dict[tuple[int, int], torch.Tensor]:
        """Results of this rank's work blocks ``(bucket position, block)``: whole matrices (each
        input released from ``blocks`` as it goes to NS), then the blocks of split matrices in
        order."""
        whole = [key for key in sorted(blocks) if plans[key[0]].split_size == 1]
        # Each input leaves ``blocks`` as it goes to NS, so it is freed once its NS is done.
        inputs: list[torch.Tensor | None] = [blocks.pop(key) for key in whole]
        results = {
            whole[i]: result
            for i, result in compute.each_whole([plans[m] for m, _ in whole], inputs)
        }
        for key in sorted(set(blocks) - set(whole)):
            m, part = key
            group = self.split_groups[plans[m].ranks]
            results[key] = compute.split_block(plans[m], blocks[key], group, part)
        return results


def create_split_groups(
    plan: StepPlan, group: dist.ProcessGroup | None
) -> dict[tuple[int, int], dist.ProcessGroup]:
    """A process group per rank block that splits a matrix's NS and includes this rank, keyed
    ``(first group rank, size)``.

    Created in one global order on every member, with local synchronization so ranks outside a
    block (and other data-parallel groups) need not take part.

    Raises:
        ValueError: the data-parallel ranks of a block are not in increasing global order.
    """
    # One global creation order (largest blocks first) on every rank: with local
    # synchronization, creating a block before a larger block containing it deadlocks gloo.
    blocks = sorted(
        {m.ranks for m in plan.matrices if m.split_size > 1},
        key=lambda block: (-block[1], block[0]),
    )
    if not blocks:
        return {}
    my_rank = dist.get_rank(group)
    global_ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    groups = {}
    for first, size in blocks:
        if not first <= my_rank < first + size:
            continue
        members = [global_ranks[r] for r in range(first, first + size)]
        if members != sorted(members):
            raise ValueError("split NS needs data-parallel ranks in increasing global order")
        groups[(first, size)] = new_member_group(members)
    return groups

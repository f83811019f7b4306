"""Exchange buckets as cuts of a step's matrices: rounds of each owner's queue
(``bucket_by_owner_rounds``) or consecutive matrices up to a byte bound (``bucket_by_bytes``).

Pure functions of sizes, costs and owners; ``step_plan.plan_step`` and
``bucket_schedule.bucket_by_schedule`` choose among their cuts.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

__all__ = ["bucket_by_bytes", "bucket_by_owner_rounds"]


def bucket_by_owner_rounds(
    owners: Sequence[int], costs: Sequence[int], sizes: Sequence[int], bound: int | None
) -> list[list[int]]:
    """Buckets in which every rank gets its next share of NS.

    Each rank's queue is its matrices (``owners[m]``) by decreasing cost, matrix order among equal
    costs; bucket ``b`` takes a slice of every queue, every rank's summed ``sizes`` within
    ``bound`` (a matrix larger than the bound is a slice of its own, orthogonalized beside the
    other ranks' ones). The ranks meet at every bucket's exchange, so a bucket's time is its
    busiest rank's NS: of two ways to cut the queues, the one whose buckets' largest NS sum to
    less wins (ties: fewer buckets, then the first):

    - cost rounds (``_cost_rounds``): every queue cut where its summed cost comes nearest to
      ``k / B`` of the largest load, for the fewest buckets ``B`` that keep the bound; ranks
      whose queues differ in length (owners placed near their rows) still finish each bucket
      together;
    - position rounds: the same number of queue positions from every queue, as many as keep the
      bound; under ``plan_owners`` the queues run through the costs side by side.

    Returns:
        Indices of each bucket in matrix order; every index exactly once. ``None``: one bucket.
    """
    if bound is None:
        return bucket_by_bytes(sizes, None)
    queues: list[list[int]] = [[] for _ in range(max(owners, default=-1) + 1)]
    for m in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        queues[owners[m]].append(m)
    candidates = [_position_rounds(queues, sizes, bound)]
    cost_rounds = _cost_rounds(queues, costs, sizes, bound)
    if cost_rounds is not None:
        candidates.append(cost_rounds)

    def busiest_sum(buckets: list[list[int]]) -> tuple[int, int]:
        busiest = 0
        for bucket in buckets:
            loads = [0] * len(queues)
            for m in bucket:
                loads[owners[m]] += costs[m]
            busiest += max(loads)
        return busiest, len(buckets)

    return min(candidates, key=busiest_sum)


def _position_rounds(queues: list[list[int]], sizes: Sequence[int], bound: int) -> list[list[int]]:
    """Bucket ``b``: queue positions ``[p_b, p_{b+1})`` of every queue, as many positions as keep
    every rank's summed ``sizes`` within ``bound`` (at least one)."""

    def bytes_at(position: int) -> list[int]:
        return [sizes[q[position]] if position < len(q) else 0 for q in queues]

    buckets = []
    start, depth = 0, max((len(q) for q in queues), default=0)
    while start < depth:
        held, stop = bytes_at(start), start + 1
        while stop < depth:
            more = [h + b for h, b in zip(held, bytes_at(stop), strict=True)]
            if max(more) > bound:
                break
            held, stop = more, stop + 1
        buckets.append(sorted(m for q in queues for m in q[start:stop]))
        start = stop
    return buckets


def _cost_rounds(
    queues: list[list[int]], costs: Sequence[int], sizes: Sequence[int], bound: int
) -> list[list[int]] | None:
    """The fewest buckets ``B`` for which cutting every queue where its summed cost is nearest
    ``k / B`` of the largest load (``k = 1 .. B-1``; earlier where the bound needs) keeps every
    slice within ``bound``; ``None`` if no ``B`` up to the longest queue does."""
    if not any(queues):
        return None
    largest = max(sum(costs[m] for m in q) for q in queues)
    held = max(sum(sizes[m] for m in q) for q in queues)
    for count in range(max(1, -(-held // bound)), max(len(q) for q in queues) + 1):
        slices = [_cut_queue(q, costs, sizes, bound, largest, count) for q in queues]
        if all(s is not None for s in slices):
            buckets = [sorted(m for s in slices if s for m in s[b]) for b in range(count)]
            return [b for b in buckets if b]
    return None


def _cut_queue(
    queue: list[int],
    costs: Sequence[int],
    sizes: Sequence[int],
    bound: int,
    largest: int,
    count: int,
) -> list[list[int]] | None:
    """``queue`` in ``count`` slices, cut where the summed cost is nearest ``k * largest / count``
    but no later than the bound allows; ``None`` if the last slice exceeds ``bound`` (a single
    matrix may)."""
    done, held = [0], [0]
    for m in queue:
        done.append(done[-1] + costs[m])
        held.append(held[-1] + sizes[m])
    slices, start = [], 0
    for k in range(1, count):
        # The latest cut keeping the slice within the bound (one matrix at least).
        fits = max(min(start + 1, len(queue)), bisect_right(held, held[start] + bound) - 1)
        nearest = bisect_left(done, k * largest / count, start, fits + 1)
        stop = min(
            (c for c in (nearest - 1, nearest) if start <= c <= fits),
            key=lambda c: (abs(done[c] - k * largest / count), c),
        )
        slices.append(queue[start:stop])
        start = stop
    if len(queue) - start > 1 and held[-1] - held[start] > bound:
        return None
    return [*slices, queue[start:]]


def bucket_by_bytes(sizes: Sequence[int], bound: int | None) -> list[list[int]]:
    """Consecutive indices of ``sizes`` grouped so that each group's sum stays within ``bound``
    (a single larger item makes a group of its own); ``None``: one group of all."""
    if bound is None:
        return [list(range(len(sizes)))] if sizes else []
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index, size in enumerate(sizes):
        if current and current_bytes + size > bound:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets

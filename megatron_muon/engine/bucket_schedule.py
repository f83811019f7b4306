"""The sequential bucket model of an owner step: its critical path, and buckets cut to shorten it.

An owner step runs its exchange buckets one after another on every rank (``owner_pipeline``): a
rank enters bucket ``b`` when it has left bucket ``b - 1``, sends its rows of the bucket's
matrices to their workers (point-to-point, one batch per bucket), orthogonalizes what it works on
once every row of it has arrived (whole matrices first, then its blocks of split matrices, each
block with the other members of its rank block, in lock step), sends the results back, and leaves
the bucket when it holds the results of every matrix it holds rows of. A rank with nothing in a
bucket passes through it. Transfers are counted free and NS time is the planner's FLOPs, so the
model's makespan (``critical_path``) is what the step's NS costs once the buckets' exchanges and
NS are ordered as the runtime orders them: with one bucket it is the largest load; with buckets
that give one rank all the NS while the others wait on its results it is the sum of their loads.

Pure functions of plain data (``BucketJob`` per matrix, group ranks), so the planner, the plan
tool and the tests share them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "PATH_SLACK",
    "SMALLEST_BUDGET",
    "BucketJob",
    "bucket_by_schedule",
    "critical_path",
    "list_schedule",
]


# Window counts ``bucket_by_schedule`` tries per budget (each costs one pass of the bucket model).
_NUM_WINDOW_COUNTS = 8
# ``bucket_by_schedule`` holds the least memory among cuts whose critical path is within this
# factor of the shortest it found.
PATH_SLACK = 1.03
# The least budget ``bucket_by_schedule`` halves the bound down to: the model counts transfers
# free, and below 16 MiB per rank the CPU bench's buckets gained no time while each bucket's
# exchange costs a round of messages (docs/benchmarks.md, "Exchange bucket size").
SMALLEST_BUDGET = 16 * 2**20


@dataclass(frozen=True, slots=True)
class BucketJob:
    """One matrix as the bucket model sees it.

    Attributes:
        work: ``(group rank, NS FLOPs of its part)`` of each rank that orthogonalizes it: one
            entry (its owner, the whole cost), or one per member of the rank block its NS is
            split over (each its share, in rank order).
        holders: group ranks that hold rows of it (send rows in, wait for the result).
        held_bytes: fp32 bytes each worker holds while it runs (the whole matrix, or its block),
            in ``work`` order: what the bucket bound counts.
        staged_bytes: fp32 bytes of its rows each holder stages for the exchange, in ``holders``
            order (``()``: not counted).
    """

    work: tuple[tuple[int, int], ...]
    holders: tuple[int, ...]
    held_bytes: tuple[int, ...]
    staged_bytes: tuple[int, ...] = ()

    @property
    def split(self) -> bool:
        """Whether the NS is shared by a rank block (run in lock step)."""
        return len(self.work) > 1

    @property
    def duration(self) -> int:
        """Time the job's workers spend on it: the largest share (lock step)."""
        return max(flops for _, flops in self.work)


def critical_path(
    jobs: Sequence[BucketJob], buckets: Sequence[Sequence[int]], group_size: int
) -> int:
    """Makespan of the sequential bucket model (module docstring), in FLOP time.

    Args:
        jobs: every matrix of the step.
        buckets: indices into ``jobs`` of each bucket, run in this order; within a bucket a rank
            runs its whole matrices in index order, then its split blocks in index order.
        group_size: ranks in the data-parallel group.
    """
    clock = [0] * group_size
    for bucket in buckets:
        enter = list(clock)
        ready = list(clock)
        for j in bucket:
            arrive = max((enter[h] for h in jobs[j].holders), default=0)
            for rank, _ in jobs[j].work:
                ready[rank] = max(ready[rank], arrive)
        busy = list(ready)
        ordered = sorted(bucket, key=lambda j: (jobs[j].split, j))
        for j in ordered:
            job = jobs[j]
            start = max(busy[rank] for rank, _ in job.work)
            for rank, _ in job.work:
                busy[rank] = start + job.duration if job.split else busy[rank] + job.duration
        # Results travel after all of a worker's NS of the bucket; holders wait for them.
        leave = list(busy)
        for j in bucket:
            done = max(busy[rank] for rank, _ in jobs[j].work)
            for h in jobs[j].holders:
                leave[h] = max(leave[h], done)
        clock = leave
    return max(clock, default=0)


def list_schedule(jobs: Sequence[BucketJob], group_size: int) -> list[int]:
    """Start time of each job in one step without buckets, the longest first (ties: index) on
    its workers as soon as all of them are free: each rank's queue runs through the costs from
    the largest, so cutting the schedule into time windows gives every rank its next share."""
    clock = [0] * group_size
    start = [0] * len(jobs)
    for j in sorted(range(len(jobs)), key=lambda i: (-jobs[i].duration, i)):
        start[j] = max(clock[rank] for rank, _ in jobs[j].work)
        for rank, _ in jobs[j].work:
            clock[rank] = start[j] + jobs[j].duration
    return start


def bucket_by_schedule(
    jobs: Sequence[BucketJob],
    group_size: int,
    bound: int | None,
    extra: Callable[[int], list[list[int]]] | None = None,
) -> list[list[int]]:
    """Buckets of the least held memory among those whose critical path is within
    ``PATH_SLACK`` of the shortest found, every worker holding at most ``bound`` fp32 bytes per
    bucket (a job larger than the bound alone): ``bound`` is a budget, spent where it shortens
    the step. Holding less than ``SMALLEST_BUDGET`` counts as holding that much (ties: fewer
    buckets, each a round of messages the model does not count).

    Candidates, for the bound and each halving of it down to the smallest job or
    ``SMALLEST_BUDGET``: ``extra(b)``
    (e.g. the owner rounds within ``b``); consecutive jobs of ``list_schedule`` in start order,
    each bucket as full as ``b`` allows; and cuts of that schedule into ``k`` equal time windows
    for a few ``k`` that keep ``b``. Ties: fewer buckets, then the first.

    Returns:
        Indices of each bucket in index order; every index once. ``None``: one bucket.
    """
    if not jobs:
        return []
    if bound is None:
        return [list(range(len(jobs)))]
    start = list_schedule(jobs, group_size)
    order = sorted(range(len(jobs)), key=lambda j: (start[j], j))
    smallest = min(min(job.held_bytes) for job in jobs)
    candidates: list[list[list[int]]] = []
    budget = bound
    while True:
        if extra is not None:
            candidates.append([sorted(b) for b in extra(budget)])
        candidates.append(_greedy(jobs, order, group_size, budget))
        candidates += _windows(jobs, start, group_size, budget)
        if budget <= smallest or budget // 2 < SMALLEST_BUDGET:
            break
        budget //= 2
    paths = [critical_path(jobs, c, group_size) for c in candidates]
    shortest = min(paths)
    fits = [i for i, path in enumerate(paths) if path <= PATH_SLACK * shortest]
    # Memory under SMALLEST_BUDGET counts as that much: there the fewer buckets win.
    best = min(
        fits,
        key=lambda i: (
            max(SMALLEST_BUDGET, _held(jobs, candidates[i], group_size)),
            len(candidates[i]),
            i,
        ),
    )
    return candidates[best]


def _held(jobs: Sequence[BucketJob], buckets: list[list[int]], group_size: int) -> int:
    """The most fp32 bytes one rank holds in one bucket: what it works on and its rows staged."""
    most = 0
    for bucket in buckets:
        held = [0] * group_size
        for j in bucket:
            job = jobs[j]
            for (rank, _), size in zip(job.work, job.held_bytes, strict=True):
                held[rank] += size
            for rank, size in zip(job.holders, job.staged_bytes, strict=False):
                held[rank] += size
        most = max(most, max(held))
    return most


def _greedy(
    jobs: Sequence[BucketJob], order: Sequence[int], group_size: int, bound: int
) -> list[list[int]]:
    buckets: list[list[int]] = []
    current: list[int] = []
    held = [0] * group_size
    for j in order:
        job = jobs[j]
        over = any(
            held[rank] and held[rank] + size > bound
            for (rank, _), size in zip(job.work, job.held_bytes, strict=True)
        )
        if over:
            buckets.append(sorted(current))
            current, held = [], [0] * group_size
        current.append(j)
        for (rank, _), size in zip(job.work, job.held_bytes, strict=True):
            held[rank] += size
    if current:
        buckets.append(sorted(current))
    return buckets


def _windows(
    jobs: Sequence[BucketJob], start: Sequence[int], group_size: int, bound: int
) -> list[list[list[int]]]:
    """Cuts of the schedule into ``k`` equal time windows that keep the bound, for up to
    ``_NUM_WINDOW_COUNTS`` counts ``k`` spread geometrically from the fewest the bytes allow to
    four per job of the busiest rank (finer windows seldom help)."""
    makespan = max(s + job.duration for s, job in zip(start, jobs, strict=True))
    depth, total = [0] * group_size, [0] * group_size
    for job in jobs:
        for (rank, _), size in zip(job.work, job.held_bytes, strict=True):
            depth[rank] += 1
            total[rank] += size
    fewest, most = max(1, max(total) // bound), max(1, 4 * max(depth))
    counts = sorted(
        {
            round(fewest * (most / fewest) ** (i / (_NUM_WINDOW_COUNTS - 1)))
            for i in range(_NUM_WINDOW_COUNTS)
        }
        if most > fewest
        else {fewest}
    )
    cuts = []
    for count in counts:
        width = max(1, -(-makespan // count))
        slots: dict[int, list[int]] = {}
        held: dict[tuple[int, int], list[int]] = {}
        for j, job in enumerate(jobs):
            window = min(start[j] // width, count - 1)
            slots.setdefault(window, []).append(j)
            for (rank, _), size in zip(job.work, job.held_bytes, strict=True):
                held.setdefault((window, rank), []).append(size)
        if all(len(sizes) == 1 or sum(sizes) <= bound for sizes in held.values()):
            cuts.append([sorted(slots[w]) for w in sorted(slots)])
    return cuts

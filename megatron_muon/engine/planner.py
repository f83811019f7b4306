"""Owner planning: which data-parallel ranks orthogonalize which full matrix.

Pure functions of the matrices' shapes, the group size (and, for ``place_near_rows``, where their
rows are), so every rank (and every TP rank of the same matrices) computes the identical plan
without communicating.

- ``plan_owners``: one owner per matrix, largest NS cost first onto the least-loaded rank (LPT
  scheduling; within 4/3 of the optimum makespan), ties broken by matrix index then rank (the
  exchange buckets are rounds of each owner's matrices: ``bucket_cuts.bucket_by_owner_rounds``).
- ``owner_locality.place_near_rows`` then moves (and swaps) a one-owner plan's owners to ranks
  that already hold more of their matrices' rows, so fewer rows travel, no rank's load above the
  plan's largest.
- ``plan_split_owners``: the same, and where one owner per matrix cannot balance the ranks (ranks
  outnumber matrices, or one matrix's NS exceeds a rank's fair share) the largest matrices' NS is
  split over an aligned block of 2, 4, ... ranks (``split_newton_schulz``), exact to the full
  result. A split is chosen only where it lowers the largest per-rank load, counting the split
  NS traffic at ``flops_per_byte``.

Executing a split plan (``ShardedMuon``): for matrix ``m`` with ``split_size(m) == g > 1``, rank
``members(m)[j]`` holds block ``j`` (``split_bounds``) along ``split_dim_of_pieces(pieces)``, and
the block's ranks call ``split_scaled_orthogonalize`` on each piece with the process group of that
aligned block; every rank runs its split matrices in matrix order. Create the block groups in one
global order, largest blocks first: with ``use_local_synchronization=True`` (gloo), a 2-rank block
created before the 4-rank block containing it deadlocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_muon.newton_schulz.cost_model import (
    split_dim_of_pieces,
    split_ns_bytes,
    split_pieces_flops,
)

__all__ = ["OwnerPlan", "plan_owners", "plan_split_owners"]

# Matrices whose NS costs less than this many FLOPs are never split over ranks (the default of
# ``plan_split_owners``, ``plan_step`` and ``ShardedMuon``): a split adds ``1 + 2 * num_ns_steps``
# collectives per piece (tens of microseconds each); 1e11 FLOPs is about a quarter of a
# millisecond of bf16 NS on an H100.
MIN_SPLIT_FLOPS = 10**11
# Target shares tried: T, T/2, ... (finer ones let big matrices split further than small ones).
_GRANULARITIES = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass(frozen=True, slots=True)
class OwnerPlan:
    """Which ranks orthogonalize each matrix, and each rank's NS load.

    Attributes:
        owners: ``owners[i]`` is the group rank that orthogonalizes matrix ``i`` or, when matrix
            ``i`` is split, the first rank of the block that shares it.
        loads: ``loads[r]`` is the summed cost of the work rank ``r`` does (for a split matrix, its
            own part: ``split_ns_flops``).
        split_sizes: ``split_sizes[i]`` ranks share matrix ``i``'s NS: ranks
            ``owners[i] .. owners[i] + split_sizes[i] - 1`` (an aligned block:
            ``owners[i] % split_sizes[i] == 0``). Empty means every matrix has a single owner.
        critical_path: the step's NS makespan in FLOP time under its exchange buckets
            (``bucket_schedule.critical_path``; ``step_plan.plan_step`` sets it); ``None``: not
            computed (a plan without buckets).
    """

    owners: tuple[int, ...]
    loads: tuple[int, ...]
    split_sizes: tuple[int, ...] = ()
    critical_path: int | None = None

    def __post_init__(self) -> None:
        assert not self.split_sizes or len(self.split_sizes) == len(self.owners)

    @property
    def max_over_mean(self) -> float:
        """Makespan over the perfectly balanced load (1.0 is perfect)."""
        total = sum(self.loads)
        return max(self.loads) * len(self.loads) / total if total else 1.0

    @property
    def critical_path_over_mean(self) -> float:
        """``critical_path`` over the mean load (1.0: the buckets add no wait to a balanced
        plan); ``max_over_mean`` where ``critical_path`` is unknown."""
        total = sum(self.loads)
        if self.critical_path is None or not total:
            return self.max_over_mean
        return self.critical_path * len(self.loads) / total

    def split_size(self, index: int) -> int:
        """How many ranks share matrix ``index`` (1: a single owner)."""
        return self.split_sizes[index] if self.split_sizes else 1

    def members(self, index: int) -> range:
        """The group ranks that orthogonalize matrix ``index`` (one rank unless split)."""
        return range(self.owners[index], self.owners[index] + self.split_size(index))

    def split_matrices(self) -> list[int]:
        """Indices of the matrices whose NS is split over more than one rank, in matrix order."""
        return [i for i in range(len(self.owners)) if self.split_size(i) > 1]


def plan_owners(costs: Sequence[int], group_size: int) -> OwnerPlan:
    """Assigns each matrix to one owner rank, largest cost first onto the least-loaded rank.

    Args:
        costs: NS cost (e.g. ``ns_flops``) of each matrix, in the optimizer's fixed param order.
        group_size: number of ranks in the data-parallel group.

    Returns:
        The plan (``loads``: of ``costs`` only); identical on every rank given identical
        arguments.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    owners = [0] * len(costs)
    heap = [(0, rank) for rank in range(group_size)]
    heapq.heapify(heap)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + costs[index], rank))
    loads = [0] * group_size
    for index, owner in enumerate(owners):
        loads[owner] += costs[index]
    return OwnerPlan(owners=tuple(owners), loads=tuple(loads))


def plan_split_owners(
    costs: Sequence[int],
    group_size: int,
    split_pieces: Sequence[Sequence[tuple[int, int]] | None],
    num_ns_steps: int,
    *,
    max_split: int = 16,
    tolerance: float = 1.05,
    slack: float = 0.01,
    min_split_cost: int = MIN_SPLIT_FLOPS,
    flops_per_byte: float = 0.0,
    element_bytes: int = 2,
    num_targets: int = 6,
) -> OwnerPlan:
    """``plan_owners``, splitting the largest matrices' NS over small aligned blocks where it helps.

    Starts from ``plan_owners``; if its max/mean load exceeds ``tolerance``, tries target per-rank
    loads ``T`` between the lower bound and the unsplit makespan, each with a granularity ``d``
    (``_GRANULARITIES``): each splittable matrix gets the smallest power-of-two block (at most
    ``max_split`` and ``group_size``) whose per-rank share is at most ``T / d`` (``d > 1`` cuts
    matrices that fit ``T`` but would pack badly, e.g. 70 matrices of 0.7 T on 64 ranks); then
    largest share first, each matrix goes onto the least-loaded rank (block size 1) or the aligned
    block with the smallest maximum load. Of the plans whose makespan is within ``slack`` of the
    smallest, the one that splits least wins (least ``sum (g - 1) k^2`` over split pieces: the
    split NS collectives' volume), ties to the earlier tried.

    Args:
        costs: NS cost of each matrix (``ns_flops``; a QKV-split param: the sum of its pieces).
        group_size: number of ranks in the data-parallel group.
        split_pieces: per matrix, the ``(rows, cols)`` of the NS jobs it is made of (one matrix,
            or Q, K, V of a QKV-split param), or ``None`` if its NS must not be split (e.g. its NS
            uses TP collectives). A matrix is split only if ``split_dim_of_pieces`` allows it;
            the summed ``ns_flops`` of its pieces must equal ``costs[i]``.
        num_ns_steps: NS iterations (the split cost model, ``split_ns_flops``).
        max_split: largest block of ranks one matrix may be split over (a power of two).
        tolerance: max/mean load under which the unsplit plan is kept as is.
        slack: relative makespan a plan may give up for less splitting.
        min_split_cost: matrices cheaper than this are never split (``MIN_SPLIT_FLOPS``: why).
        flops_per_byte: what one byte of split-NS traffic costs in NS FLOPs (e.g. NS throughput
            over link bandwidth, ~1e3 over NVLink, ~1e4 over InfiniBand): each split member's
            load counts its share of FLOPs plus this times ``split_ns_bytes``, so splits whose
            traffic outweighs their balance gain are not taken. 0 (default): balance FLOPs only.
            1e3 is NVLink-class (bf16 NS at ~600 TFLOP/s over ~500 GB/s).
            ``loads`` of the plan are FLOPs either way.
        element_bytes: bytes per element of split-NS traffic (2: bf16 under "medium" precision).
        num_targets: target loads tried per granularity (planning time grows linearly with it).

    Returns:
        The plan; identical on every rank given identical arguments.
    """
    if len(split_pieces) != len(costs):
        raise ValueError(f"split_pieces has {len(split_pieces)} entries for {len(costs)} costs")
    if max_split < 1 or max_split & (max_split - 1):
        raise ValueError(f"max_split must be a power of two, got {max_split}")
    if tolerance < 1.0:
        raise ValueError(f"tolerance must be at least 1.0, got {tolerance}")
    if slack < 0.0:
        raise ValueError(f"slack must be non-negative, got {slack}")
    if num_targets < 1:
        raise ValueError(f"num_targets must be at least 1, got {num_targets}")
    best = plan_owners(costs, group_size)
    sizes = [g for g in (2**e for e in range(1, 31)) if g <= min(max_split, group_size)]
    pieces_of = {
        i: pieces
        for i, pieces in enumerate(split_pieces)
        if pieces is not None
        and costs[i] >= max(min_split_cost, 1)
        and split_dim_of_pieces(pieces) is not None
    }
    splittable = list(pieces_of)
    if not sizes or not splittable or best.max_over_mean <= tolerance:
        return best

    # Per-rank FLOPs of each splittable matrix for each block size (index 0: unsplit), and the
    # planning cost: FLOPs plus the split traffic priced at flops_per_byte.
    table: dict[tuple[tuple[int, int], ...], tuple[list, list]] = {}
    shares: dict[int, list[tuple[int, ...]]] = {}
    weighted: dict[int, list[tuple[int, ...]]] = {}
    for i in splittable:
        key = tuple((rows, cols) for rows, cols in pieces_of[i])
        if key not in table:
            flops = [(costs[i],)] + [
                tuple(split_pieces_flops(key, num_ns_steps, g, j) for j in range(g)) for g in sizes
            ]
            priced = [flops[0]] + [
                tuple(
                    f + round(flops_per_byte * split_ns_bytes(key, num_ns_steps, g, element_bytes))
                    for f in share
                )
                for g, share in zip(sizes, flops[1:], strict=True)
            ]
            table[key] = (flops, priced)
        shares[i], weighted[i] = table[key]
    lower = max(
        sum(costs) / group_size,
        max(min(max(s) for s in weighted[i]) for i in splittable),
        max((c for i, c in enumerate(costs) if i not in shares), default=0),
    )
    unsplit_makespan = max(best.loads)
    if lower >= unsplit_makespan:
        return best
    volume = {i: sum(min(piece) ** 2 for piece in pieces_of[i]) for i in splittable}
    largest = {i: [max(share) for share in weighted[i]] for i in splittable}
    candidates = [(best, max(best.loads), 0)]
    tried: set[tuple[int, ...]] = set()
    for granularity in _GRANULARITIES:
        # From the least splitting (targets near the unsplit makespan) down to the lower bound.
        for step in range(num_targets, -1, -1):
            target = lower * (unsplit_makespan / lower) ** (step / num_targets) / granularity
            choice = {}
            for i in splittable:
                fits = [k for k, share in enumerate(largest[i]) if share <= target]
                choice[i] = fits[0] if fits else len(sizes)
            signature = tuple(choice.values())
            if signature in tried:  # many targets pick the same block sizes
                continue
            tried.add(signature)
            plan, makespan = _gang_schedule(costs, group_size, shares, weighted, choice)
            split_volume = sum((len(shares[i][k]) - 1) * volume[i] for i, k in choice.items())
            candidates.append((plan, makespan, split_volume))
    shortest = min(makespan for _, makespan, _ in candidates)
    eligible = [c for c in candidates if c[1] <= shortest * (1 + slack)]
    return min(eligible, key=lambda c: c[2])[0]


def _gang_schedule(
    costs: Sequence[int],
    group_size: int,
    shares: dict[int, list[tuple[int, ...]]],
    weighted: dict[int, list[tuple[int, ...]]],
    choice: dict[int, int],
) -> tuple[OwnerPlan, int]:
    """LPT where matrix ``i`` takes the aligned block of ``len(shares[i][choice[i]])`` ranks.

    Places by the ``weighted`` (planning) cost; returns the plan (FLOP loads) and its weighted
    makespan.
    """
    planned = np.zeros(group_size, dtype=np.int64)  # weighted loads, which placement balances
    loads = np.zeros(group_size, dtype=np.int64)  # FLOPs
    heap = [(0, rank) for rank in range(group_size)]  # lazy: entries go stale when blocks land
    owners = [0] * len(costs)
    split_sizes = [1] * len(costs)
    work = [weighted[i][choice[i]] if i in choice else (costs[i],) for i in range(len(costs))]
    for index in sorted(range(len(costs)), key=lambda i: (-max(work[i]), i)):
        share = work[index]
        flops = shares[index][choice[index]] if index in choice else share
        size = len(share)
        if size == 1:
            while True:  # least-loaded rank, lowest rank among ties (as plan_owners)
                load, rank = heapq.heappop(heap)
                if load == planned[rank]:
                    break
            planned[rank] += share[0]
            heapq.heappush(heap, (int(planned[rank]), rank))
        else:
            num_blocks = group_size // size
            block_max = planned[: num_blocks * size].reshape(num_blocks, size).max(axis=1)
            rank = int(np.argmin(block_max)) * size
            planned[rank : rank + size] += share
            for member in range(rank, rank + size):
                heapq.heappush(heap, (int(planned[member]), member))
        loads[rank : rank + size] += flops
        owners[index] = rank
        split_sizes[index] = size
    plan = OwnerPlan(
        owners=tuple(owners),
        loads=tuple(int(x) for x in loads),
        split_sizes=tuple(split_sizes) if any(s > 1 for s in split_sizes) else (),
    )
    return plan, int(planned.max())

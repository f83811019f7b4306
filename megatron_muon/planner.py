"""Owner planning: which data-parallel rank orthogonalizes which full matrix.

A pure function of the matrices' shapes and the group size, so every rank (and every TP rank of the
same matrices) computes the identical plan without communicating. Largest NS cost first onto the
least-loaded rank (LPT scheduling; within 4/3 of the optimum makespan), ties broken by matrix index
then rank, so the plan is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["OwnerPlan", "plan_owners"]


@dataclass(frozen=True, slots=True)
class OwnerPlan:
    """Owner rank (index into the data-parallel group) of each matrix, and each rank's NS load.

    Attributes:
        owners: ``owners[i]`` is the group rank that orthogonalizes matrix ``i``.
        loads: ``loads[r]`` is the summed cost of the matrices rank ``r`` owns.
    """

    owners: tuple[int, ...]
    loads: tuple[int, ...]

    @property
    def max_over_mean(self) -> float:
        """Makespan over the perfectly balanced load (1.0 is perfect)."""
        total = sum(self.loads)
        return max(self.loads) * len(self.loads) / total if total else 1.0

    def owned_by(self, rank: int) -> list[int]:
        """Indices of the matrices ``rank`` owns, in matrix order."""
        return [i for i, owner in enumerate(self.owners) if owner == rank]


def plan_owners(costs: Sequence[int], group_size: int) -> OwnerPlan:
    """Assigns each matrix to one owner rank, largest cost first onto the least-loaded rank.

    Args:
        costs: NS cost (e.g. ``ns_flops``) of each matrix, in the optimizer's fixed param order.
        group_size: number of ranks in the data-parallel group.

    Returns:
        The plan; identical on every rank given identical ``costs``.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    owners = [0] * len(costs)
    heap = [(0, rank) for rank in range(group_size)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + costs[index], rank))
    loads = [0] * group_size
    for index, owner in enumerate(owners):
        loads[owner] += costs[index]
    return OwnerPlan(owners=tuple(owners), loads=tuple(loads))

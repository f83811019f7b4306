"""Owners placed near their rows: a one-owner plan (``planner.plan_owners``) whose owners are
moved and swapped to ranks that already hold more of their matrices' rows, so fewer rows travel
in the exchange, with no rank's NS load above the plan's largest.

Pure functions of the costs and the traffic table, so every rank computes the identical plan
without communicating (``step_plan.plan_step`` applies it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_muon.engine.planner import OwnerPlan

__all__ = ["place_near_rows"]

# Improvement passes of ``place_near_rows`` (each over the matrices not on their best rank).
_LOCALITY_PASSES = 8


def place_near_rows(
    plan: OwnerPlan, costs: Sequence[int], traffic: Sequence[Sequence[int]]
) -> OwnerPlan:
    """``plan``'s owners placed where the fewest rows travel, no rank's load above ``plan``'s
    largest.

    Megatron-FSDP shards a flat buffer of several params, so a rank often holds all or most rows of
    a matrix; owning it there sends nothing. Two starts are improved and the one moving the fewest
    elements wins (ties: ``plan``): ``plan`` itself, and largest cost first onto the rank with the
    least traffic among those it fits on within the cap (if every matrix fits somewhere). Each is
    improved by moves (a matrix to a rank with less traffic and room under the cap) and swaps (two
    matrices of different ranks exchange owners) while the total traffic falls. A plan whose NS is
    split over ranks is returned as is.

    Args:
        plan: a one-owner plan of ``costs`` (``plan_owners``).
        costs: NS cost of each matrix.
        traffic: ``traffic[m][r]``: elements sent to and back from rank ``r`` if it owns matrix
            ``m`` (0 where it holds every row).

    Returns:
        A plan whose largest load is at most ``plan``'s; identical on every rank given identical
        arguments.
    """
    group_size = len(plan.loads)
    if plan.split_sizes or group_size < 2 or not costs:
        return plan
    cost = np.asarray(costs, dtype=np.int64)
    table = np.asarray(traffic, dtype=np.int64).reshape(len(costs), group_size)
    cap = max(plan.loads)
    best = np.asarray(plan.owners, dtype=np.int64)
    best_traffic = _improve_locality(best, cost, table, cap)
    greedy = _nearest_fitting_owners(cost, table, cap)
    if greedy is not None and _improve_locality(greedy, cost, table, cap) < best_traffic:
        best = greedy
    loads = np.zeros(group_size, dtype=np.int64)
    np.add.at(loads, best, cost)
    return OwnerPlan(owners=tuple(int(o) for o in best), loads=tuple(int(x) for x in loads))


def _nearest_fitting_owners(cost: np.ndarray, table: np.ndarray, cap: int) -> np.ndarray | None:
    """Largest cost first onto the fitting rank (load within ``cap``) with the least traffic,
    then the least load, then the lowest rank; ``None`` if a matrix fits nowhere."""
    loads = np.zeros(table.shape[1], dtype=np.int64)
    owners = np.zeros(len(cost), dtype=np.int64)
    for m in sorted(range(len(cost)), key=lambda i: (-int(cost[i]), i)):
        fits = np.flatnonzero(loads + cost[m] <= cap)
        if not len(fits):
            return None
        rank = int(fits[np.lexsort((fits, loads[fits], table[m, fits]))[0]])
        owners[m] = rank
        loads[rank] += cost[m]
    return owners


def _improve_locality(owners: np.ndarray, cost: np.ndarray, table: np.ndarray, cap: int) -> int:
    """Moves and swaps ``owners`` (in place) while the total traffic falls and every load stays
    within ``cap``, for at most ``_LOCALITY_PASSES`` passes over the matrices not on their
    least-traffic rank; returns the total traffic."""
    loads = np.zeros(table.shape[1], dtype=np.int64)
    np.add.at(loads, owners, cost)
    matrices = np.arange(len(cost))
    best = table.min(axis=1)
    for _ in range(_LOCALITY_PASSES):
        improved = False
        for m in np.flatnonzero(table[matrices, owners] > best).tolist():
            here = int(owners[m])
            # Move: the rank with the least traffic that has room for m.
            gain = np.where(loads + cost[m] <= cap, table[m, here] - table[m], 0)
            rank = int(np.argmax(gain))
            if gain[rank] > 0:
                loads[here] -= cost[m]
                loads[rank] += cost[m]
                owners[m] = rank
                improved = True
                continue
            # Swap: m onto a rank with less traffic for it, that rank's matrix o onto m's rank.
            others = np.flatnonzero(table[m, owners] < table[m, here])
            there = owners[others]
            gain = table[m, here] - table[m, there] + table[others, there] - table[others, here]
            delta = cost[others] - cost[m]  # load change on m's rank; o's rank gets -delta
            fits = (loads[here] + delta <= cap) & (loads[there] - delta <= cap)
            gain = np.where(fits, gain, 0)
            if len(others) and gain.max() > 0:
                o = int(others[np.argmax(gain)])
                rank = int(owners[o])
                loads[here] += cost[o] - cost[m]
                loads[rank] -= cost[o] - cost[m]
                owners[m], owners[o] = rank, here
                improved = True
        if not improved:
            break
    return int(table[matrices, owners].sum())

"""Which data-parallel rank owns each matrix's optimizer state and work: memory and FLOPs balanced.

An optimizer whose state and work need the whole matrix (SOAP's Kronecker factors and eigenbases,
PSGD's Kronecker-factored preconditioner) keeps each ``(m, n)`` matrix on one owner rank
(``engine.owner_compute``). ``plan_state_owners`` places the matrices given the optimizer's own
cost functions (state bytes and FLOPs of one ``(m, n)`` matrix; ``optimizers.soap_plan``,
``optimizers.psgd_pro``) so that both are spread evenly: largest state first, each onto the rank
whose larger relative load (state bytes over the mean, FLOPs over the mean) stays smallest (ties:
smaller state load, then lower rank). A pure function of the shapes and the group size: every rank
computes the same plan, the same at every step, so state never moves between ranks while the layout
stays (a checkpoint moves it: ``engine.owner_state``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["MatrixCostFn", "StateOwnerPlan", "plan_state_owners"]

#: A cost of one ``(m, n)`` matrix (state bytes, or FLOPs per step).
MatrixCostFn = Callable[[tuple[int, int]], int]


@dataclass(frozen=True, slots=True)
class StateOwnerPlan:
    """Owner of each matrix and each rank's load.

    Attributes:
        owners: ``owners[i]``: the group rank holding matrix ``i``'s state and doing its work.
        state_bytes: ``state_bytes[r]``: bytes of optimizer state rank ``r`` holds.
        flops: ``flops[r]``: FLOPs of the work rank ``r`` does per step.
    """

    owners: tuple[int, ...]
    state_bytes: tuple[int, ...]
    flops: tuple[int, ...]

    @property
    def state_max_over_mean(self) -> float:
        """The largest rank's state bytes over the mean (1.0: perfectly even)."""
        return _max_over_mean(self.state_bytes)

    @property
    def flops_max_over_mean(self) -> float:
        """The busiest rank's FLOPs over the mean (1.0: perfectly even)."""
        return _max_over_mean(self.flops)


def _max_over_mean(loads: Sequence[int]) -> float:
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


def plan_state_owners(
    shapes: Sequence[tuple[int, int]],
    num_ranks: int,
    state_bytes: MatrixCostFn,
    flops: MatrixCostFn,
    label: str = "the owner planner",
) -> StateOwnerPlan:
    """One owner per ``(m, n)`` matrix over ``num_ranks`` ranks, ``state_bytes`` and ``flops``
    balanced (module docstring). Deterministic: a function of its arguments only.

    Raises:
        ValueError: ``num_ranks < 1`` or a shape that is not ``(m, n)`` with ``m, n >= 0``
            (the message starts with ``label``).
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    for shape in shapes:
        if len(shape) != 2 or min(shape) < 0:
            raise ValueError(f"{label} plans (m, n) matrices, got shape {tuple(shape)}")
    memory = [state_bytes(s) for s in shapes]
    work = [flops(s) for s in shapes]
    memory_mean = max(sum(memory) / num_ranks, 1.0)
    work_mean = max(sum(work) / num_ranks, 1.0)
    owners = [0] * len(shapes)
    memory_load = [0] * num_ranks
    work_load = [0] * num_ranks
    for i in sorted(range(len(shapes)), key=lambda i: (-memory[i], -work[i], i)):

        def cost(rank: int, i: int = i) -> tuple[float, int, int]:
            after = max(
                (memory_load[rank] + memory[i]) / memory_mean,
                (work_load[rank] + work[i]) / work_mean,
            )
            return after, memory_load[rank], rank

        rank = min(range(num_ranks), key=cost)
        owners[i] = rank
        memory_load[rank] += memory[i]
        work_load[rank] += work[i]
    return StateOwnerPlan(tuple(owners), tuple(memory_load), tuple(work_load))

"""Which data-parallel rank owns each matrix's SOAP state and work: memory and FLOPs balanced.

SOAP keeps whole-matrix state (``soap_matrix``): for an ``(m, n)`` matrix the Adam moments
``2 m n``, the Kronecker factors and their eigenbases ``2 m^2 + 2 n^2`` fp32 numbers, and does
whole-matrix work every step (factor updates ``~ m n (m + n)``, eigenbasis refresh ``~ m^3 + n^3``,
four projections ``~ m n (m + n)``). Each matrix lives on one owner rank; ``plan_soap_owners``
places them so that both the state bytes and the FLOPs are spread evenly: largest state first, each
onto the rank whose larger relative load (state bytes over the mean, FLOPs over the mean) stays
smallest (ties: smaller state load, then lower rank). A pure function of the shapes and the group
size: every rank computes the same plan, the same at every step, so state never moves between
ranks while the layout stays (a checkpoint moves it: ``sharded_soap``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SoapOwnerPlan", "plan_soap_owners", "soap_flops", "soap_state_bytes"]


def soap_state_bytes(shape: tuple[int, int]) -> int:
    """Bytes of one ``(m, n)`` matrix's SOAP state (fp32 moments, factors and eigenbases)."""
    m, n = shape
    return 4 * (2 * m * n + 2 * m * m + 2 * n * n)


def soap_flops(shape: tuple[int, int]) -> int:
    """Approximate FLOPs of one ``(m, n)`` matrix's SOAP step: the factor updates and the four
    projections (``2 m n (m + n)`` each pair of GEMMs), and the eigenbasis refresh (about ``10
    k^3`` for a ``k x k`` factor: sort, power iteration and QR)."""
    m, n = shape
    return 6 * 2 * m * n * (m + n) + 10 * (m**3 + n**3)


@dataclass(frozen=True, slots=True)
class SoapOwnerPlan:
    """Owner of each matrix and each rank's load.

    Attributes:
        owners: ``owners[i]``: the group rank holding matrix ``i``'s state and doing its work.
        state_bytes: ``state_bytes[r]``: bytes of SOAP state rank ``r`` holds.
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


def plan_soap_owners(shapes: Sequence[tuple[int, int]], num_ranks: int) -> SoapOwnerPlan:
    """One owner per ``(m, n)`` matrix over ``num_ranks`` ranks, state bytes and FLOPs balanced
    (module docstring). Deterministic: a function of ``shapes`` and ``num_ranks`` only.

    Raises:
        ValueError: ``num_ranks < 1`` or a shape that is not ``(m, n)`` with ``m, n >= 0``.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    for shape in shapes:
        if len(shape) != 2 or min(shape) < 0:
            raise ValueError(f"SOAP plans (m, n) matrices, got shape {tuple(shape)}")
    memory = [soap_state_bytes(s) for s in shapes]
    work = [soap_flops(s) for s in shapes]
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
    return SoapOwnerPlan(tuple(owners), tuple(memory_load), tuple(work_load))

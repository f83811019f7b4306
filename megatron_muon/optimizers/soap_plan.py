"""SOAP's costs for the owner planner (``engine.state_owners``): state bytes and FLOPs per matrix.

SOAP keeps whole-matrix state (``soap_matrix``): for an ``(m, n)`` matrix the Adam moments
``2 m n``, the Kronecker factors and their eigenbases ``2 m^2 + 2 n^2`` fp32 numbers, and does
whole-matrix work every step (factor updates ``~ m n (m + n)``, eigenbasis refresh ``~ m^3 + n^3``,
four projections ``~ m n (m + n)``). ``plan_soap_owners`` is ``engine.state_owners``'s planner
with these costs (``SoapOwnerPlan``: the engine's ``StateOwnerPlan``).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_muon.engine.state_owners import StateOwnerPlan, plan_state_owners

__all__ = ["SoapOwnerPlan", "plan_soap_owners", "soap_flops", "soap_state_bytes"]

#: The plan ``plan_soap_owners`` returns (the engine's ``StateOwnerPlan``; the 0.1 name).
SoapOwnerPlan = StateOwnerPlan


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


def plan_soap_owners(shapes: Sequence[tuple[int, int]], num_ranks: int) -> StateOwnerPlan:
    """One owner per ``(m, n)`` matrix over ``num_ranks`` ranks, SOAP's state bytes and FLOPs
    balanced (``engine.state_owners.plan_state_owners``). Deterministic: a function of ``shapes``
    and ``num_ranks`` only.

    Raises:
        ValueError: ``num_ranks < 1`` or a shape that is not ``(m, n)`` with ``m, n >= 0``.
    """
    return plan_state_owners(shapes, num_ranks, soap_state_bytes, soap_flops, "SOAP")

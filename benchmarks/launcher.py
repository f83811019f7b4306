"""Runs a benchmark rank body on N ranks: the multi-rank launcher (``megatron_muon.testing``),
whose ranks never hang (a timeout names the ranks that did not finish) and report every failure.

On CPU each rank runs one thread on gloo with the CPU stand-ins applied; with ``device="cuda"``
each rank drives its own GPU over NCCL. A benchmark run may take minutes: 600 s per launch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_muon.testing import DeviceT, run_on_ranks

__all__ = ["run_ranks"]

BENCH_TIMEOUT_S = 600.0


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    device: DeviceT,
    *args: Any,
    timeout: float = BENCH_TIMEOUT_S,
) -> list[Any]:
    """``fn(rank, world_size, device, *args)`` on ``world_size`` ranks; results in rank order.

    ``fn`` must be a module-level function (it is pickled by reference).

    Raises:
        megatron_muon.testing.RankFailure: a rank raised (its traceback in the message).
        megatron_muon.testing.RankTimeout: ranks did not finish within ``timeout`` seconds (600 by
            default; named in the message).
    """
    from benchmarks.machine import quiet_rank

    return run_on_ranks(quiet_rank, world_size, fn, device, *args, timeout=timeout, device=device)

"""Timing and memory probes used inside benchmark ranks.

Time: ``timed(fn)`` brackets ``fn`` with barriers (and a device synchronize on GPUs), so every rank
reads the wall time of the whole collective step; the benchmarks take the median over repeats after
warm-up.

Memory, two probes:
- ``MemoryProbe``: on CPU, peak resident set size (Linux ``VmHWM``, reset by writing 5 to
  ``/proc/self/clear_refs``) minus the resident size at ``start()``; on GPUs,
  ``max_memory_allocated`` minus ``memory_allocated`` at ``start()``. glibc keeps freed heap memory
  resident (below its dynamic mmap threshold, up to 32 MiB), which would hide transients, so
  ``return_freed_memory_to_os`` makes every allocation of 64 KiB or more its own mapping, returned
  when freed; it is called only in processes that measure RSS, never before timing.
- ``tensor_memory_peak``: peak bytes of live CPU tensors during one call (the profiler's
  allocation records): exact, and free of what RSS also holds (library code, kernel JIT caches).

Where a step's time goes: ``time_split`` profiles one call and splits its wall time into the time
inside named profiler scopes (``record_function``; the optimizer marks Newton-Schulz and its
collective waits), the copies outside them, and the rest.
"""

from __future__ import annotations

import ctypes
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "MemoryProbe",
    "tensor_memory_peak",
    "growth_exponent",
    "interleaved_times",
    "median",
    "return_freed_memory_to_os",
    "synchronize",
    "time_split",
    "timed",
]

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter number (malloc.h)
_MMAP_THRESHOLD_BYTES = 64 * 1024


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved_times(
    fns: Sequence[Callable[[], object]], warmup: int, repeats: int, device: str = "cpu"
) -> list[list[float]]:
    """Seconds of each call of each function (one rank, no barrier), the functions timed
    alternately so that all see the same machine load (the CPU may be shared; back-to-back blocks
    of repeats would compare different loads); a GPU is synchronized around each call."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times, strict=True):
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            samples.append(time.perf_counter() - start)
    return times


def timed(fn: Callable[[], object], device: str, group: dist.ProcessGroup | None = None) -> float:
    """Wall seconds of ``fn`` between two barriers over ``group`` (all ranks see the same span)."""
    synchronize(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    fn()
    synchronize(device)
    dist.barrier(group=group)
    return time.perf_counter() - start


def return_freed_memory_to_os() -> None:
    """Makes glibc map large allocations separately and release them on free (CPU memory probes)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    if libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed; CPU memory figures would be wrong")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class MemoryProbe:
    """Peak memory above the level at ``start()``: RSS on CPU, allocated CUDA memory on GPUs."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.baseline = 0

    def current(self) -> int:
        """Bytes in use now (RSS, or CUDA memory allocated)."""
        if self.device == "cuda":
            return torch.cuda.memory_allocated()
        return 1024 * _status_kib("VmRSS")

    def start(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        self.baseline = self.current()

    def peak(self) -> int:
        """Absolute peak bytes since ``start()``."""
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return 1024 * _status_kib("VmHWM")

    def peak_above_start(self) -> int:
        return self.peak() - self.baseline


def tensor_memory_peak(fn: Callable[[], object], device: str) -> int:
    """Peak bytes of live CPU tensors during ``fn``, above those alive when it starts.

    Replays the profiler's allocation records (every tensor allocation and free, time-stamped)
    and takes the highest running total: exact, and independent of the allocator and of the OS
    (unlike RSS, which also holds library code and freed-but-kept heap). The records are read from
    ``prof.profiler.kineto_results``: the profiler's public memory timeline
    (``export_memory_timeline``) rebuilds a data-flow graph first, whose validation fails
    intermittently on these steps ("duplicate outputs: aten::to").
    """
    from torch.profiler import ProfilerActivity, profile

    if device != "cpu":
        raise ValueError(f"tensor_memory_peak is for CPU tensors; on {device} use MemoryProbe")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    total = peak = 0
    for _, nbytes in records:
        total += nbytes
        peak = max(peak, total)
    return peak


# Operators that only move data (a copy, a concatenation, a dtype conversion, a gather by index).
COPY_OPS = frozenset(
    {
        "aten::copy_",
        "aten::cat",
        "aten::stack",
        "aten::clone",
        "aten::_to_copy",
        "aten::contiguous",
        "aten::index",
        "aten::index_select",
    }
)


def time_split(fn: Callable[[], object], scopes: dict[str, str]) -> dict[str, float]:
    """Wall seconds of one call of ``fn`` on this thread, split by the PyTorch profiler.

    Args:
        fn: the call to profile (one optimizer step).
        scopes: ``{part name: record_function scope name}``; a part is the summed duration of its
            scope's outermost occurrences (a scope inside another listed scope counts there).

    Returns:
        ``{"total": s, <part>: s for each scope, "copies": s, "other": s}``: ``copies`` is the
        time of ``COPY_OPS`` operators outside every listed scope (outermost copies only),
        ``other`` what remains (elementwise math, Python, allocation).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        total = time.perf_counter() - start
    names = set(scopes.values())
    seconds = dict.fromkeys(scopes.values(), 0.0)
    copies = 0.0
    for event in prof.events():
        ancestors = set()
        parent = event.cpu_parent
        while parent is not None:
            ancestors.add(parent.name)
            parent = parent.cpu_parent
        if event.name in names and not ancestors & names:
            seconds[event.name] += event.cpu_time_total / 1e6
        elif event.name in COPY_OPS and not ancestors & (names | COPY_OPS):
            copies += event.cpu_time_total / 1e6
    split = {"total": total, **{part: seconds[scope] for part, scope in scopes.items()}}
    split["copies"] = copies
    split["other"] = total - sum(v for k, v in split.items() if k != "total")
    return split


def growth_exponent(sizes: Sequence[float], seconds: Sequence[float]) -> float:
    """Least-squares slope of log(seconds) against log(size): time ~ size ** exponent."""
    xs = [math.log(s) for s in sizes]
    ys = [math.log(t) for t in seconds]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    num = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    den = sum((x - mean_x) ** 2 for x in xs)
    return num / den

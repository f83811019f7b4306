"""Runs a benchmark function on N ranks: gloo on CPU (one thread per rank), NCCL on GPUs.

Ranks start from a forkserver that preloaded torch and megatron, so a launch costs well under a
second after the first. On CPU the stand-ins of ``megatron_muon.cpu_stand_ins`` are applied in each
rank (megatron-core and megatron_fsdp make CUDA-only calls). A rank that raises fails the whole
benchmark with its traceback; ranks that do not finish within ``timeout`` are killed.
"""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_module
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.optimizer",
    "megatron.core.models.gpt",
    "megatron.core.distributed",
    "megatron_fsdp",
    "emerging_optimizers",
    "megatron_muon",
    "benchmarks.launcher",
]

_context: Any = None


class BenchmarkRankError(RuntimeError):
    """A rank raised, or ranks did not finish in time."""


def _get_context() -> Any:
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _encode(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _rank_entry(fn, rank, world_size, store_path, device, results, args) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=600),
        )
        if device == "cpu":
            from megatron_muon import cpu_stand_ins

            cpu_stand_ins.install()
        results.put((rank, "ok", _encode(fn(rank, world_size, device, *args))))
    except BaseException:  # noqa: BLE001 - every failure must reach the caller
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(
    fn: Callable[..., Any], world_size: int, device: str, *args: Any, timeout: float = 600.0
) -> list[Any]:
    """Runs ``fn(rank, world_size, device, *args)`` on ``world_size`` ranks; results in rank order.

    ``fn`` must be a module-level function (it is pickled by reference).
    """
    ctx = _get_context()
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="mm_bench_")
    store_path = os.path.join(store_dir, "store")
    processes = [
        ctx.Process(
            target=_rank_entry,
            args=(fn, rank, world_size, store_path, device, results, args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=0.1)
            except queue_module.Empty:
                dead = [
                    r for r, p in enumerate(processes) if r not in outcomes and not p.is_alive()
                ]
                if dead and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        raise BenchmarkRankError(
                            f"ranks {dead} of {world_size} exited without a report "
                            f"(exit codes {[processes[r].exitcode for r in dead]})"
                        ) from None
                continue
            outcomes[rank] = (status, payload)
            if status == "error":
                raise BenchmarkRankError(f"rank {rank} of {world_size} failed:\n{payload}")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=5)
        try:
            os.remove(store_path)
        except OSError:
            pass
        os.rmdir(store_dir)
    missing = sorted(set(range(world_size)) - set(outcomes))
    if missing:
        raise BenchmarkRankError(
            f"ranks {missing} of {world_size} did not finish in {timeout:.0f} s"
        )
    return [torch.load(io.BytesIO(outcomes[r][1]), weights_only=False) for r in range(world_size)]

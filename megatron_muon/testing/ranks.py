"""Run a function on N ranks in one call, fast, never hanging: multi-rank unit tests on CPU.

``run_on_ranks(fn, world_size, *args, timeout=..., device="cpu")`` starts ``world_size`` processes
from a forkserver whose preload already imported torch, megatron-core and megatron_fsdp (a launch
then costs well under a second after the first), initialises a process group through a fresh file
store (no ports to race for), calls ``fn(rank, world_size, *args)`` and returns the per-rank
results in rank order. On CPU each rank runs one thread on gloo with the CPU stand-ins of
``megatron_muon.cpu_stand_ins`` applied; with ``device="cuda"`` each rank drives GPU ``rank`` over
NCCL. This project's tests and benchmarks launch through it; so can a user's own tests.

- A rank that raises: ``RankFailure`` carries every failed rank's traceback; ranks stuck in a
  collective with the failed one are killed.
- A rank that does not finish within ``timeout`` seconds: ``RankTimeout`` names the ranks that did
  not finish, and every rank is killed.

``fn`` must be a module-level function (it is pickled by reference). Results travel back through
``torch.save`` bytes, so tensors and nested containers of them are fine.

``set_launch_check(check)`` installs a function called before every launch (a test suite uses it
to require a marker on the tests that launch processes: this project's ``tests/multirank.py``).
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0
DeviceT = Literal["cpu", "cuda"]
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
    "megatron_muon.testing.ranks",
]

_contexts: dict[str, Any] = {}
_launch_check: Callable[[str], None] | None = None


def set_launch_check(check: Callable[[str], None] | None) -> None:
    """Installs ``check(what)``, called before every launch (``what``: e.g. ``"3 ranks"``).

    ``check`` raises to refuse the launch; ``None`` removes it. A test suite installs one to tie
    launches to a marker (this project's ``tests/conftest.py`` does, for ``multirank``).
    """
    global _launch_check
    _launch_check = check


class RankFailure(RuntimeError):
    """One or more ranks raised; the message holds each failed rank's traceback."""


class RankTimeout(TimeoutError):
    """Some ranks did not finish within the timeout; the message names them."""


def _get_context(device: DeviceT) -> Any:
    """CPU: a forkserver with ``_PRELOAD`` imported (fast launches). CUDA: spawn, since a process
    forked from one where CUDA is initialised cannot use CUDA ("Cannot re-initialize CUDA in forked
    subprocess"), and importing megatron-core on a GPU machine initialises it."""
    if device not in _contexts:
        if device == "cuda":
            _contexts[device] = mp.get_context("spawn")
        else:
            _contexts[device] = mp.get_context("forkserver")
            _contexts[device].set_forkserver_preload(_PRELOAD)
    return _contexts[device]


def _encode(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _decode(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    results: Any,
    args: tuple,
    kwargs: dict,
    collective_timeout_s: float,
    device: DeviceT,
) -> None:
    import datetime

    import torch.distributed as dist

    from megatron_muon import cpu_stand_ins

    try:
        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
            device_id=torch.device("cuda", rank) if device == "cuda" else None,
        )
        if device == "cpu":
            cpu_stand_ins.install()
        result = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", _encode(result)))
    except BaseException:  # noqa: BLE001 - every failure must reach the caller
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    device: DeviceT = "cpu",
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks.

    ``device``: ``"cpu"`` (gloo, one thread per rank, CPU stand-ins applied) or ``"cuda"`` (NCCL,
    rank ``r`` on GPU ``r``). ``timeout`` bounds the whole run and each collective.

    Returns:
        The ranks' return values, in rank order.

    Raises:
        RankFailure: a rank raised (all failed ranks' tracebacks in the message).
        RankTimeout: ranks did not finish within ``timeout`` seconds (named in the message).
        Whatever the check installed by ``set_launch_check`` raises, before any process starts.
    """
    if _launch_check is not None:
        _launch_check(f"{world_size} ranks")
    ctx = _get_context(device)
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="mm_store_")
    store_path = os.path.join(store_dir, "store")
    processes = [
        ctx.Process(
            target=_rank_entry,
            args=(fn, rank, world_size, store_path, results, args, kwargs, timeout, device),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()

    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    first_error_at: float | None = None
    try:
        while len(outcomes) < world_size:
            now = time.monotonic()
            # After a failure, peers blocked in a collective with the failed rank never return:
            # give them a moment to report their own errors, then stop waiting.
            if first_error_at is not None and now - first_error_at > 3.0:
                break
            if now > deadline:
                break
            try:
                rank, status, payload = results.get(timeout=0.05)
                outcomes[rank] = (status, payload)
                if status == "error" and first_error_at is None:
                    first_error_at = time.monotonic()
            except queue_module.Empty:
                dead = [
                    r for r, p in enumerate(processes) if r not in outcomes and not p.is_alive()
                ]
                if dead:
                    # Exit without a report (a hard crash, e.g. SIGABRT in gloo): wait once more.
                    time.sleep(0.2)
                    while True:
                        try:
                            rank, status, payload = results.get_nowait()
                            outcomes[rank] = (status, payload)
                        except queue_module.Empty:
                            break
                    for r in dead:
                        if r not in outcomes:
                            code = processes[r].exitcode
                            outcomes[r] = ("error", f"rank {r} exited with code {code}, no report")
                            if first_error_at is None:
                                first_error_at = time.monotonic()
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=5)
        try:
            os.remove(store_path)
            os.rmdir(store_dir)
        except OSError:
            pass

    errors = {r: payload for r, (status, payload) in outcomes.items() if status == "error"}
    if errors:
        missing = sorted(set(range(world_size)) - set(outcomes))
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        extra = f"\nranks {missing} were still running and were killed" if missing else ""
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed:\n{text}{extra}")
    missing = sorted(set(range(world_size)) - set(outcomes))
    if missing:
        raise RankTimeout(
            f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s "
            f"(finished: {sorted(outcomes)})"
        )
    return [_decode(outcomes[r][1]) for r in range(world_size)]

"""Launch a script on N CPU ranks forked from a process that has already imported Megatron.

Each torchrun launch of a test spends most of its time importing: ``megatron.training`` with torch
and megatron-core is about 12 s of CPU per rank (measured on 2 cores, 2026-11-29), while a test's
6 iterations of the tiny GPT take a second or two. ``run_megatron`` (``tests/torchrun.py``)
therefore starts ranks the way ``torch.multiprocessing``'s forkserver does: a *zygote* process
(this file run as a script) imports ``PRELOAD`` once, then for every launch forks a leader, which
forks one process per rank. Each rank gets the environment torchrun gives its workers (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...),
writes its stdout and stderr where torchrun's ``--log-dir --redirects 3`` writes them, and runs
the script as ``__main__``. As torchrun does, the leader ends the other ranks when one exits
non-zero (after ``FAILURE_GRACE_S``, so that every rank that refuses a run prints why) and exits 1.

Importing ``PRELOAD`` first changes nothing a run computes: it is the order the test driver
imports in anyway (``megatron.training.training`` before the example's ``install()``), and no
module of it reads the per-launch environment at import. A zygote serves launches with one
environment, up to the variables that are read at run time only (``is_per_launch``: the test
drivers' ``MEGATRON_MUON_*`` switches, such as a floor run's weight nudge, and Megatron's
``CUDA_DEVICE_MAX_CONNECTIONS``, read in its argument checks), which each launch's ranks get set
as the launch asks; a launch with any other difference (a variable a test set) gets its own
zygote, and the ``MAX_ZYGOTES`` most recently used stay. Each zygote costs an import of
``PRELOAD`` (9 s on 2 cores, measured 2026-12-02): keyed on the whole environment, five of the
loop-test modules started 10 zygotes, now 1 (docs/testing.md).

torchrun itself stays in the tests that need it (``--max-restarts``, the agent's store, signals:
``tests/test_torchrun_restarts.py``), on a GPU (CUDA cannot be used in a forked child of a process
that initialised it), and everywhere with ``MEGATRON_MUON_TEST_LAUNCHER=torchrun``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

PRELOAD = (
    "megatron.training.training",
    "megatron_muon.integrations.megatron_lm",
    "megatron_muon.cpu_stand_ins",
)
FAILURE_GRACE_S = 5.0
MAX_ZYGOTES = 2
LAUNCHER_VARIABLE = "MEGATRON_MUON_TEST_LAUNCHER"
_READY = "ZYGOTE_READY"
# Set by pytest for each test; left out, so that one zygote serves every test.
_PER_TEST_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})
# Read at run time only, never at the import of PRELOAD (module docstring): set per launch.
_PER_LAUNCH_PREFIX = "MEGATRON_MUON_"
_PER_LAUNCH_VARIABLES = frozenset({"CUDA_DEVICE_MAX_CONNECTIONS"})


def is_per_launch(name: str) -> bool:
    """Whether the variable ``name`` is set per launch in a shared zygote (module docstring)."""
    return (
        name.startswith(_PER_LAUNCH_PREFIX) and name != LAUNCHER_VARIABLE
    ) or name in _PER_LAUNCH_VARIABLES


# --------------------------------------------------------------------------------------------------
# The test side
# --------------------------------------------------------------------------------------------------


class _Zygote:
    """One zygote process (``env`` is its whole environment) and its request pipe."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="mm_zygote_", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [sys.executable, __file__],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
        )
        self._received = b""  # read from the pipe, not yet returned as a line
        self.leader: int | None = None  # the last launch's leader (its process group)
        ready = self._read_line(timeout=300.0)
        if ready != _READY:
            raise RuntimeError(f"the launch zygote did not start ({ready!r}); see {self.log.name}")

    def _read_line(self, timeout: float) -> str | None:
        """The zygote's next reply line, or ``None`` after ``timeout`` seconds. Reads the pipe's
        file descriptor itself: a buffered reader may hold the next line already, which
        ``select`` on the descriptor cannot see."""
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._received:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([self.process.stdout], [], [], max(remaining, 0.0))
            if not ready:
                return None
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the launch zygote exited; see {self.log.name}")
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line.decode().strip()

    def launch(self, request: dict, timeout: float) -> int | None:
        """Runs one launch; its exit code (torchrun's: 0, or 1 when a rank failed), or ``None``
        when it ran past ``timeout`` seconds (every rank is then killed)."""
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        started = self._read_line(timeout=60.0)
        if started is None:
            raise RuntimeError(f"the launch zygote did not fork a launch; see {self.log.name}")
        leader = int(json.loads(started)["leader"])
        self.leader = leader
        reply = self._read_line(timeout=timeout)
        if reply is None:
            try:
                os.killpg(leader, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._read_line(timeout=60.0)  # the zygote reports the killed leader
            return None
        return int(json.loads(reply)["returncode"])

    def kill(self) -> None:
        """Ends the zygote and its launch at once (a launch interrupted half-way, whose replies
        would answer the next request)."""
        if self.leader is not None:
            try:
                os.killpg(self.leader, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.kill()
        self.process.wait()

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


_zygotes: dict[tuple[tuple[str, str], ...], _Zygote] = {}
_lock = threading.Lock()


def _close_all() -> None:
    for zygote in _zygotes.values():
        zygote.close()


def can_fork(target: list[str]) -> bool:
    """Whether ``target`` (what would follow torchrun's own options) runs forked: a script path or
    ``-m module``, no torchrun option, no GPU, and ``MEGATRON_MUON_TEST_LAUNCHER`` not
    ``torchrun``."""
    if os.environ.get(LAUNCHER_VARIABLE, "forked") == "torchrun":
        return False
    if not target or (target[0].startswith("-") and target[0] != "-m"):
        return False
    import torch

    return not torch.cuda.is_available()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_forked(
    target: list[str], nproc: int, log_dir: Path, env: dict[str, str], cwd: Path, timeout: float
) -> int | None:
    """Runs ``target`` (``[script, *args]`` or ``["-m", module, *args]``) on ``nproc`` forked
    ranks; each rank's output in ``log_dir/forked/attempt_0/<rank>/{stdout,stderr}.log``.

    Returns the exit code (0, or 1 when a rank failed), or ``None`` on a timeout.
    """
    env = {name: value for name, value in env.items() if name not in _PER_TEST_VARIABLES}
    launch_env = {name: value for name, value in env.items() if is_per_launch(name)}
    env = {name: value for name, value in env.items() if name not in launch_env}
    request = {
        "target": target,
        "nproc": nproc,
        "log_dir": str(log_dir / "forked" / "attempt_0"),
        "env": launch_env,
    }
    key = tuple(sorted(env.items()))
    with _lock:  # launches from several threads (tests/stock_parity.py) take turns
        return _launch_on_zygote(key, env, cwd, request, timeout)


def _launch_on_zygote(
    key: tuple[tuple[str, str], ...], env: dict[str, str], cwd: Path, request: dict, timeout: float
) -> int | None:
    request = {**request, "master_port": _free_port()}
    if not _zygotes:
        atexit.register(_close_all)  # the test process's exit ends every zygote
    if key not in _zygotes:
        while len(_zygotes) >= MAX_ZYGOTES:  # about 1 GB each: end the least recently used
            _zygotes.pop(next(iter(_zygotes))).close()
        _zygotes[key] = _Zygote(env, cwd)
    _zygotes[key] = _zygotes.pop(key)  # the most recently used last
    try:
        return _zygotes[key].launch(request, timeout)
    except BaseException:  # e.g. pytest-timeout: this zygote's next reply would be stale
        _zygotes.pop(key).kill()
        raise


# --------------------------------------------------------------------------------------------------
# The zygote side
# --------------------------------------------------------------------------------------------------


def _rank_environment(rank: int, nproc: int, master_port: int) -> dict[str, str]:
    """What torchrun ``--standalone`` sets for a worker (on one node), its store aside."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": "none",
    }


def _redirect(fd: int, path: Path) -> None:
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(handle, fd)
    os.close(handle)


def _exit_code(exit: SystemExit) -> int:
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code
    print(exit.code, file=sys.stderr)
    return 1


def _run_rank(request: dict, rank: int) -> None:
    """In a rank's process: run the request's ``target`` as ``__main__`` as ``python`` would, with
    the launch's own variables set (``is_per_launch``), then exit as the interpreter does
    (non-daemon threads joined, ``atexit`` handlers run)."""
    import runpy

    target, nproc = request["target"], int(request["nproc"])
    rank_dir = Path(request["log_dir"]) / str(rank)
    rank_dir.mkdir(parents=True, exist_ok=True)
    _redirect(0, Path(os.devnull))
    _redirect(1, rank_dir / "stdout.log")
    _redirect(2, rank_dir / "stderr.log")
    os.environ.update(request["env"])
    os.environ.update(_rank_environment(rank, nproc, int(request["master_port"])))
    code = 0
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            sys.path[0] = str(Path(target[0]).resolve().parent)
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as exit:
        code = _exit_code(exit)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _lead(request: dict) -> int:
    """In the leader: fork the ranks, wait for them as torchrun does; 0, or 1 if a rank failed."""
    ranks = {}
    for rank in range(int(request["nproc"])):
        pid = os.fork()
        if pid == 0:
            _run_rank(request, rank)
        ranks[pid] = rank
    failed_at = None
    while ranks:
        if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)
        pid, status = os.waitpid(-1, os.WNOHANG if failed_at is not None else 0)
        if pid == 0:
            time.sleep(0.05)
            continue
        ranks.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0 and failed_at is None:
            failed_at = time.monotonic()
    return 0 if failed_at is None else 1


def _serve() -> None:
    """The zygote: import ``PRELOAD``, then one launch per request line, replies on stdout."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    reply = sys.stdout
    print(_READY, file=reply, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        leader = os.fork()
        if leader == 0:
            os.setsid()
            _redirect(0, Path(os.devnull))
            _redirect(1, Path(os.devnull))
            os._exit(_lead(request))
        print(json.dumps({"leader": leader}), file=reply, flush=True)
        _, status = os.waitpid(leader, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=reply, flush=True)


if __name__ == "__main__":
    _serve()

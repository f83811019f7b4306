"""The forked launcher of ``run_megatron`` (``tests/forked_launch.py``) behaves as torchrun does:
each rank sees torchrun's worker environment, a hanging rank is named within the timeout, and one
rank's failure ends the launch with torchrun's exit code after the other ranks are stopped."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests import forked_launch
from tests.torchrun import DONE_MARKER, TorchrunTimeout, run_megatron

pytestmark = pytest.mark.multirank

ENV_MARKER = "RANK_ENV "
# What a worker reads of torchrun's environment (torch.distributed's env://, Megatron, ours).
WORKER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
)
SCRIPT = f"""
import json, os, sys, time
rank = int(os.environ["RANK"])
names = {WORKER_VARIABLES!r} + ("MASTER_ADDR", "MASTER_PORT")
print({ENV_MARKER!r} + json.dumps({{name: os.environ.get(name) for name in names}}), flush=True)
mode = sys.argv[1]
if mode == "hang" and rank == 1:
    time.sleep(600)
if mode == "fail":
    if rank == 0:
        sys.exit(3)
    time.sleep(600)  # stopped by the launcher once rank 0 failed
print({DONE_MARKER!r}, flush=True)
"""


def _launch(tmp_path: Path, mode: str, **kwargs):
    script = tmp_path / "rank_script.py"
    script.write_text(SCRIPT)
    return run_megatron(
        [mode], nproc=2, entry=[str(script)], entry_prints_done_marker=True, **kwargs
    )


def _environments(run) -> list[dict[str, str]]:
    return [
        json.loads(line[len(ENV_MARKER) :])
        for rank in sorted(run.rank_outputs)
        for line in run.rank_outputs[rank].splitlines()
        if line.startswith(ENV_MARKER)
    ]


def test_each_forked_rank_sees_the_worker_environment_torchrun_gives(tmp_path, monkeypatch):
    assert forked_launch.can_fork([str(tmp_path / "rank_script.py")])
    forked = _environments(_launch(tmp_path, "ok"))
    monkeypatch.setenv(forked_launch.LAUNCHER_VARIABLE, "torchrun")
    torchrun = _environments(_launch(tmp_path, "ok"))
    assert [{n: env[n] for n in WORKER_VARIABLES} for env in forked] == [
        {n: env[n] for n in WORKER_VARIABLES} for env in torchrun
    ]
    assert all(env["MASTER_ADDR"] and env["MASTER_PORT"] for env in forked)


def test_a_hanging_forked_rank_is_named_within_the_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(TorchrunTimeout, match=r"ranks \[1\] of 2 did not finish within 20 s"):
        _launch(tmp_path, "hang", timeout=20)
    assert time.monotonic() - start < 60


def test_one_failing_forked_rank_ends_the_launch_with_torchruns_exit_code(tmp_path):
    start = time.monotonic()
    failed = _launch(tmp_path, "fail", check=False, timeout=120)
    assert failed.returncode == 1  # torchrun's, whatever the rank's own code
    assert time.monotonic() - start < forked_launch.FAILURE_GRACE_S + 60  # rank 1 was stopped
    assert DONE_MARKER not in failed.rank_outputs[1]

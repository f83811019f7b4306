"""Run Megatron-LM's training loop under ``torchrun`` from a test, with a timeout that names ranks.

``run_megatron(script_args, nproc=2, timeout=...)`` launches ``torchrun --nproc-per-node N``
on ``tests/megatron_lm_driver.py`` (which runs ``examples/pretrain_gpt_megatron.py``), each rank's
output in its own file (torchrun ``--log-dir --redirects 3``), and returns a ``MegatronRun`` with
the per-iteration values parsed from the loop's own log lines (``lm loss``, ``grad norm``, ...),
and what the driver printed after training (param row layouts). On a timeout every process is
killed and ``TorchrunTimeout`` names the ranks that never printed the driver's end marker; a
non-zero exit raises ``TorchrunFailure`` with the tail of each rank's output.

On CPU the ranks are forked from a process that imported Megatron once, with torchrun's worker
environment and log layout (``tests/forked_launch.py`` says why and when torchrun itself runs).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import forked_launch
from tests.multirank import require_multirank_marker

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tests" / "megatron_lm_driver.py"
DONE_MARKER = "MEGATRON_MUON_DRIVER_DONE"
LAYOUT_MARKER = "MEGATRON_MUON_LAYOUT "
OPTIMIZER_MARKER = "MEGATRON_MUON_OPTIMIZER "
GRAD_NORMS_MARKER = "MEGATRON_MUON_GRAD_NORMS "

MEGATRON_FSDP_FLAGS = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
# The flags every test run shares: 2 gloo CPU ranks, the local (non-TE) GPT spec, no CUDA fusions,
# no dropout, a tiny GPT (2 layers, hidden 64) on mock data, one log line per iteration.
TINY_GPT_CPU_FLAGS = [
    *("--distributed-backend gloo --use-cpu-initialization --transformer-impl local").split(),
    *("--no-gradient-accumulation-fusion --no-gradient-reduce-div-fusion").split(),
    *("--no-bias-gelu-fusion --no-bias-dropout-fusion --no-masked-softmax-fusion").split(),
    *("--no-rope-fusion --no-persist-layer-norm").split(),
    *("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32").split(),
    *("--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 4").split(),
    *("--hidden-dropout 0 --attention-dropout 0 --seed 1234").split(),
    *("--mock-data --tokenizer-type NullTokenizer --vocab-size 128").split(),
    *("--log-interval 1 --eval-iters 0 --eval-interval 1000 --lr-decay-style constant").split(),
    *MEGATRON_FSDP_FLAGS,
]

# Muon in the loop tests: fp32 Newton-Schulz matmuls (tests/test_megatron_lm_loop.py says why).
NUM_ITERS = 6
MUON_FLAGS = [
    *("--optimizer muon --lr 0.02 --muon-fp32-matmul-prec high").split(),
    *("--train-iters", str(NUM_ITERS)),
]

# The expert-parallel loop tests: iterations and flags (Muon, 4 experts, QK-clip; MLA on top).
EP_ITERS = 5
# 4 experts, no linear biases (megatron-core 0.19.2's SequentialMLP adds its bias in place on a
# view that autograd refuses at EP=1), the all-to-all dispatcher (the uneven all-to-all path),
# QK-clip low enough that heads are clipped in the later iterations.
MOE_FLAGS = [
    *("--optimizer muon --lr 0.02 --muon-fp32-matmul-prec high").split(),
    *("--num-experts 4 --disable-bias-linear --moe-token-dispatcher-type alltoall").split(),
    *("--data-parallel-sharding-strategy optim_grads_params").split(),
    *("--qk-clip --qk-clip-threshold 0.5").split(),
    *("--train-iters", str(EP_ITERS)),
]

# Multi-latent attention with q-LoRA (DeepSeek-V3's attention) in place of the GPT's attention,
# after MOE_FLAGS. Its max logits are smaller (0.03 at iteration 1 on one rank, up to 0.10 later
# unclipped): at 0.04 iteration 1 clips nothing, later ones some or all of the 8 heads.
MLA_FLAGS = [
    *("--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 32 --qk-head-dim 16").split(),
    *("--qk-pos-emb-head-dim 8 --v-head-dim 16 --position-embedding-type rope").split(),
    *("--qk-clip-threshold", "0.04"),
]

_ITERATION_LINE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
_FIELD = re.compile(r"\s*([a-z][a-z ]*[a-z]):\s*([-+0-9.eE]+|nan|inf)\s*$")


class TorchrunFailure(RuntimeError):
    """torchrun exited non-zero; the message holds each rank's output tail."""


class TorchrunTimeout(TimeoutError):
    """The run did not finish in time; the message names the ranks that did not finish."""


@dataclass
class MegatronRun:
    """What one launch printed: per-iteration fields, layouts, optimizer, outputs, wall time."""

    iterations: dict[int, dict[str, float]]
    layouts: dict[int, dict[str, list[int]]]
    rank_outputs: dict[int, str]
    wall_s: float
    optimizers: dict[int, dict[str, Any]] = field(default_factory=dict)
    # Rank 0's grad norm of every optimizer step, at full precision (the log rounds it).
    grad_norms: list[float | None] = field(default_factory=list)
    returncode: int = 0  # non-zero only from run_megatron(..., check=False)

    def series(self, name: str = "lm loss") -> list[float]:
        """One field over the iterations, in iteration order."""
        return [self.iterations[i][name] for i in sorted(self.iterations)]


def parse_iteration_lines(text: str) -> dict[int, dict[str, float]]:
    """Megatron's ``training_log`` lines -> {iteration: {field: value}} (duplicates collapse)."""
    iterations: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        match = _ITERATION_LINE.search(line)
        if not match:
            continue
        fields: dict[str, float] = {}
        for part in match.group(3).split("|"):
            field_match = _FIELD.match(part)
            if field_match:
                fields[field_match.group(1)] = float(field_match.group(2))
        iterations[int(match.group(1))] = fields
    return iterations


def _rank_files(log_dir: Path, nproc: int) -> dict[int, list[Path]]:
    files: dict[int, list[Path]] = {rank: [] for rank in range(nproc)}
    for path in log_dir.rglob("*.log"):
        # torchrun: <log_dir>/<run_id>/attempt_<n>/<rank>/{stdout,stderr}.log
        try:
            rank = int(path.parent.name)
        except ValueError:
            continue
        if rank in files:
            files[rank].append(path)
    return files


def _read_ranks(log_dir: Path, nproc: int) -> dict[int, str]:
    """Each rank's stderr then stdout (``stderr.log`` sorts first)."""
    outputs = {}
    for rank, paths in _rank_files(log_dir, nproc).items():
        outputs[rank] = "\n".join(p.read_text(errors="replace") for p in sorted(paths))
    return outputs


def _failure_tails(log_dir: Path, nproc: int, ranks: list[int], chars: int = 2000) -> str:
    """The end of each rank's stdout and stderr (a native crash shows only in stderr)."""
    parts = []
    for rank, paths in _rank_files(log_dir, nproc).items():
        if rank not in ranks:
            continue
        for path in sorted(paths):
            parts.append(
                f"--- rank {rank} {path.name} ---\n{path.read_text(errors='replace')[-chars:]}"
            )
    return "\n".join(parts)


def run_megatron(
    script_args: list[str],
    *,
    nproc: int = 2,
    timeout: float = 150.0,
    install: bool = True,
    env: dict[str, str] | None = None,
    entry: list[str] | None = None,
    entry_prints_done_marker: bool = False,
    check: bool = True,
    megatron_fsdp: bool = True,
) -> MegatronRun:
    """Runs the example on ``nproc`` CPU ranks (forked, or under torchrun) and parses what the
    loop printed.

    Args:
        script_args: Megatron flags after ``TINY_GPT_CPU_FLAGS`` (later flags win in argparse).
        install: ``False`` runs the example with ``install()`` replaced by the CPU stand-ins
            alone (stock megatron.training, for the behaviour-preserved test).
        entry: run this instead of the driver (e.g. ``["-m", "megatron_muon.pretrain"]``), with
            ``script_args`` alone (no ``TINY_GPT_CPU_FLAGS``, no end marker to wait for unless
            ``entry_prints_done_marker``).
        check: ``False`` returns a run that exits non-zero (``returncode``) instead of raising
            ``TorchrunFailure``; a timeout still raises.
        megatron_fsdp: ``False`` leaves ``MEGATRON_FSDP_FLAGS`` out of ``TINY_GPT_CPU_FLAGS``
            (Megatron's own DDP and checkpoint format: a stock reference).
    """
    wait_for_marker = entry is None or entry_prints_done_marker
    require_multirank_marker(f"torchrun with {nproc} ranks")
    common = (
        TINY_GPT_CPU_FLAGS if megatron_fsdp else TINY_GPT_CPU_FLAGS[: -len(MEGATRON_FSDP_FLAGS)]
    )
    target = (
        [str(DRIVER), *([] if install else ["--no-megatron-muon-install"]), *common]
        if entry is None
        else list(entry)
    )
    log_dir = Path(tempfile.mkdtemp(prefix="mm_torchrun_"))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",
        f"--log-dir={log_dir}",
        "--redirects=3",
        *target,
        *script_args,
    ]
    run_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "NO_VCS_VERSION": "1",
        # Megatron's initialization compiles its bias-GeLU and bias-dropout-add fusions for a
        # warm-up even when the flags turn them off (as TINY_GPT_CPU_FLAGS do); nothing the tests
        # check is compiled, and skipping it saves 10-30 s of every launch on 2 cores (as
        # `make demo` and `make test-avx2` do).
        "TORCHDYNAMO_DISABLE": "1",
        **(env or {}),
    }
    start = time.monotonic()
    if forked_launch.can_fork(target):
        returncode = forked_launch.run_forked(
            [*target, *script_args], nproc, log_dir, run_env, REPO, timeout
        )
        return _parse_launch(log_dir, nproc, returncode, "", start, timeout, wait_for_marker, check)
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        launcher_output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        launcher_output, _ = process.communicate()
        return _parse_launch(log_dir, nproc, None, "", start, timeout, wait_for_marker, check)
    return _parse_launch(
        log_dir, nproc, process.returncode, launcher_output, start, timeout, wait_for_marker, check
    )


def _parse_launch(
    log_dir: Path,
    nproc: int,
    returncode: int | None,
    launcher_output: str,
    start: float,
    timeout: float,
    wait_for_marker: bool,
    check: bool,
) -> MegatronRun:
    """The ``MegatronRun`` of a finished launch (``returncode``; ``None``: it timed out, which
    raises ``TorchrunTimeout`` naming the ranks without the end marker)."""
    if returncode is None:
        outputs = _read_ranks(log_dir, nproc)
        stuck = [rank for rank in range(nproc) if DONE_MARKER not in outputs.get(rank, "")]
        if not wait_for_marker:  # no end marker: name every rank
            stuck = list(range(nproc))
        tails = _failure_tails(log_dir, nproc, stuck)
        raise TorchrunTimeout(
            f"ranks {stuck} of {nproc} did not finish within {timeout:.0f} s\n{tails}"
        )
    wall_s = time.monotonic() - start
    outputs = _read_ranks(log_dir, nproc)
    if returncode != 0 and check:
        tails = _failure_tails(log_dir, nproc, list(range(nproc)))
        raise TorchrunFailure(
            f"the launch exited with {returncode}\n{tails}\n--- launcher ---\n"
            f"{launcher_output[-2000:]}"
        )
    not_done = [rank for rank in range(nproc) if DONE_MARKER not in outputs.get(rank, "")]
    if not_done and wait_for_marker and returncode == 0:
        raise TorchrunFailure(f"ranks {not_done} exited 0 without finishing the driver")
    iterations: dict[int, dict[str, float]] = {}
    layouts: dict[int, dict[str, list[int]]] = {}
    optimizers: dict[int, dict[str, Any]] = {}
    grad_norms: list[float | None] = []
    for rank, text in outputs.items():
        iterations.update(parse_iteration_lines(text))
        for line in text.splitlines():
            if line.startswith(LAYOUT_MARKER):
                layouts[rank] = json.loads(line[len(LAYOUT_MARKER) :])
            elif line.startswith(OPTIMIZER_MARKER):
                optimizers[rank] = json.loads(line[len(OPTIMIZER_MARKER) :])
            elif line.startswith(GRAD_NORMS_MARKER) and rank == 0:
                grad_norms = json.loads(line[len(GRAD_NORMS_MARKER) :])
    return MegatronRun(iterations, layouts, outputs, wall_s, optimizers, grad_norms, returncode)

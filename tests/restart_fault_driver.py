"""Test driver: a training run under ``torchrun`` with faults injected by attempt, rank and step.

``python tests/restart_fault_driver.py TARGET ARGS...``, TARGET one of ``megatron``
(``tests/megatron_lm_driver.py``: Megatron-LM's loop, ``install()``), ``pretrain``
(``python -m megatron_muon.pretrain``) or ``custom`` (``examples/custom_trainer.py``, its
checkpoints by ``megatron_muon.checkpointing``); ARGS are the target's.

``MEGATRON_MUON_FAULTS`` in the environment: comma-separated ``attempt:rank:kind:iteration``; in
torchrun attempt ``attempt`` (``TORCHELASTIC_RESTART_COUNT``), rank ``rank`` does, at iteration
``iteration`` (1-based, as the loop counts):

- ``kill``: SIGKILL to itself right after that iteration's optimizer step;
- ``kill_in_save``: SIGKILL to itself in the save of that iteration, right after its
  ``torch.distributed.checkpoint.save`` returned (its shard files and DCP's ``.metadata`` are
  written; Megatron's tracker file, or megatron-muon's completion marker and rename, are not);
- ``sigterm``: SIGTERM to itself right after that iteration's optimizer step.

Rank 0 prints ``MEGATRON_MUON_STEP {"attempt", "iteration", "loss", "grad_norm"}`` after every
step at full precision (JSON floats round-trip). A rank injecting a fault prints
``MEGATRON_MUON_FAULT {"kind", "iteration", "time"}`` first; ``MEGATRON_MUON_EXIT {"code", "time"}``
is printed when the target ends by ``sys.exit`` (Megatron's exit after a signal), then the end
marker.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FAULT_VARIABLE = "MEGATRON_MUON_FAULTS"
STEP_MARKER = "MEGATRON_MUON_STEP "
EXIT_MARKER = "MEGATRON_MUON_EXIT "
FAULT_MARKER = "MEGATRON_MUON_FAULT "
DONE_MARKER = "MEGATRON_MUON_DRIVER_DONE"
KINDS = ("kill", "kill_in_save", "sigterm")


@functools.cache
def _faults() -> set[tuple[str, int]]:
    """(kind, iteration) this process injects: those of its attempt and rank."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    mine = set()
    for spec in filter(None, os.environ.get(FAULT_VARIABLE, "").split(",")):
        spec_attempt, spec_rank, kind, iteration = spec.split(":")
        if kind not in KINDS:
            raise ValueError(f"{FAULT_VARIABLE}: unknown fault {kind!r} (one of {KINDS})")
        if int(spec_attempt) == attempt and int(spec_rank) == rank:
            mine.add((kind, int(iteration)))
    return mine


def _inject(kind: str, iteration: int) -> None:
    if (kind, iteration) not in _faults():
        return
    print(
        f"{FAULT_MARKER}{json.dumps({'kind': kind, 'iteration': iteration, 'time': time.time()})}",
        flush=True,
    )
    if kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def on_step(iteration: int, loss: Any, grad_norm: Any) -> None:
    """Records the step (rank 0) and injects this iteration's step faults."""
    if int(os.environ["RANK"]) == 0:
        record = {
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "iteration": iteration,
            "loss": None if loss is None else float(loss),
            "grad_norm": None if grad_norm is None else float(grad_norm),
        }
        print(STEP_MARKER + json.dumps(record), flush=True)
    _inject("kill", iteration)
    _inject("sigterm", iteration)


def _fault_after_dcp_save() -> None:
    import torch.distributed.checkpoint as dcp

    save = dcp.save

    def save_then_fault(*args: Any, **kwargs: Any) -> Any:
        result = save(*args, **kwargs)
        writer = kwargs.get("storage_writer")
        path = str(writer.path if writer is not None else kwargs.get("checkpoint_id"))
        match = re.search(r"(\d+)(?:\.incomplete)?$", path)
        if match:
            _inject("kill_in_save", int(match.group(1)))
        return result

    dcp.save = save_then_fault


def _record_megatron_steps() -> None:
    import megatron.training.training as training
    from megatron.training import get_args

    train_step = training.train_step

    def train_step_recorded(*args: Any, **kwargs: Any) -> Any:
        result = train_step(*args, **kwargs)
        loss_dict, grad_norm = result[0], result[5]
        on_step(get_args().curr_iteration + 1, loss_dict.get("lm loss"), grad_norm)
        return result

    training.train_step = train_step_recorded


def main() -> None:
    target, argv = sys.argv[1], sys.argv[2:]
    _fault_after_dcp_save()
    try:
        if target == "megatron":
            from tests import megatron_lm_driver

            _record_megatron_steps()
            sys.argv = [str(megatron_lm_driver.__file__), *argv]
            megatron_lm_driver.main()  # prints the end marker itself
            return
        if target == "pretrain":
            import megatron_muon.pretrain as pretrain

            _record_megatron_steps()
            pretrain.main(argv)
        elif target == "custom":
            from examples import custom_trainer

            custom_trainer.main(argv, on_step=on_step)
        else:
            raise ValueError(f"unknown target {target!r}: megatron, pretrain or custom")
    except SystemExit as exit:
        print(
            f"{EXIT_MARKER}{json.dumps({'code': exit.code or 0, 'time': time.time()})}", flush=True
        )
        if exit.code:
            raise
    print(DONE_MARKER, flush=True)


if __name__ == "__main__":
    main()

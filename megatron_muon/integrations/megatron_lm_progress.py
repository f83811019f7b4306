"""The pretrain entry point's progress line and run log, from Megatron-LM's own loop (patches).

``install(log)`` wraps four functions of ``megatron.training.training`` (megatron-core
``SUPPORTED_MEGATRON_CORE``, checked first: ``megatron_lm.check_megatron_core_version``); each
calls the original with the original arguments and returns its result, and only records:

1. ``setup_model_and_optimizer``: the optimizer it returns gets its ``step`` timed (to report the
   optimizer step's share of the training step);
2. ``train_step``: timed (step time, tokens/s);
3. ``training_log``: after Megatron's own log line, a progress bar on rank 0 (when stderr is a
   terminal) and, every ``--log-interval``, the line
   ``[megatron-muon] iter 10/200 | lr ... | train loss ... | val loss ... | N tokens/s |
   step T ms (optimizer P%)`` and a ``RunLog.train`` record;
4. ``evaluate``: a ``RunLog.valid`` record of the validation loss (``final`` for the evaluation
   ``pretrain`` runs after training).

Why patches: Megatron-LM's loop has no callback for any of these; the entry point wants one
summary line per interval and a machine-readable log without copying ``train()``. Timing a step
synchronizes CUDA before and after it (nothing to wait for on CPU).
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_muon.integrations.megatron_lm import check_megatron_core_version

__all__ = ["RunLog", "install"]


@dataclass
class RunLog:
    """What the run logged: one record per logged iteration, one per evaluation."""

    train: list[dict[str, float]] = field(default_factory=list)
    valid: list[dict[str, float]] = field(default_factory=list)
    step_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    steps_since_log: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"train": self.train, "valid": self.valid}


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[..., Any], add: Callable[[float], None]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        _synchronize()
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        _synchronize()
        add(time.perf_counter() - start)
        return result

    return timed


def _scalar(value: Any) -> float:
    if torch.is_tensor(value):
        value = value.detach().float().cpu()
        return float(value[0] / value[1]) if value.numel() == 2 else float(value.mean())
    return float(value)


def _progress_bar(iteration: int, total: int, width: int = 30) -> None:
    """A one-line progress bar on rank 0's stderr, only when it is a terminal."""
    if not sys.stderr.isatty() or (
        torch.distributed.is_initialized() and torch.distributed.get_rank() != 0
    ):
        return
    done = min(width, width * iteration // max(1, total))
    end = "\n" if iteration >= total else ""
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {iteration}/{total}{end}")
    sys.stderr.flush()


def install(log: RunLog) -> None:
    """Records the run into ``log`` and prints the progress line (module docstring).

    Wraps ``setup_model_and_optimizer``, ``train_step``, ``training_log`` and ``evaluate`` of
    ``megatron.training.training``, once per call: call it once per run, before ``pretrain``.

    Raises:
        RuntimeError: the installed megatron-core is not in ``SUPPORTED_MEGATRON_CORE``.
    """
    check_megatron_core_version(__name__)
    from megatron.training import get_args, print_rank_0

    training: Any = importlib.import_module("megatron.training.training")

    def add_step(seconds: float) -> None:
        log.step_seconds += seconds
        log.steps_since_log += 1

    def add_optimizer(seconds: float) -> None:
        log.optimizer_seconds += seconds

    setup = training.setup_model_and_optimizer

    def setup_and_time_optimizer(*args: Any, **kwargs: Any) -> Any:
        model, optimizer, scheduler = setup(*args, **kwargs)
        if optimizer is not None:
            optimizer.step = _timed(optimizer.step, add_optimizer)
        return model, optimizer, scheduler

    training.setup_model_and_optimizer = setup_and_time_optimizer
    training.train_step = _timed(training.train_step, add_step)

    training_log = training.training_log

    def log_progress(
        loss_dict: dict,
        total_loss_dict: dict,
        learning_rate: Any,
        iteration: int,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        result = training_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)
        run_args = get_args()
        _progress_bar(iteration, run_args.train_iters)
        if iteration % run_args.log_interval == 0 and "lm loss" in loss_dict:
            steps = max(1, log.steps_since_log)
            step_s = log.step_seconds / steps
            tokens = run_args.global_batch_size * run_args.seq_length
            record = {
                "iteration": iteration,
                "lr": float(learning_rate or 0.0),
                "train_loss": _scalar(loss_dict["lm loss"]),
                "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
                "step_ms": 1000.0 * step_s,
                "optimizer_share": log.optimizer_seconds / log.step_seconds
                if log.step_seconds > 0
                else 0.0,
            }
            log.train.append(record)
            last_valid = f"{log.valid[-1]['valid_loss']:.4f}" if log.valid else "-"
            print_rank_0(
                f"[megatron-muon] iter {iteration}/{run_args.train_iters} | "
                f"lr {record['lr']:.3e} | train loss {record['train_loss']:.4f} | "
                f"val loss {last_valid} | {record['tokens_per_s']:,.0f} tokens/s | "
                f"step {record['step_ms']:.1f} ms "
                f"(optimizer {100 * record['optimizer_share']:.0f}%)"
            )
            log.step_seconds = log.optimizer_seconds = 0.0
            log.steps_since_log = 0
        return result

    training.training_log = log_progress

    evaluate = training.evaluate

    def evaluate_and_record(*args: Any, **kwargs: Any) -> Any:
        result = evaluate(*args, **kwargs)
        total_loss_dict = result[0] if isinstance(result, tuple) else None
        if total_loss_dict and "lm loss" in total_loss_dict:
            # train() sets curr_iteration before it counts the step it is in.
            iteration = int(getattr(get_args(), "curr_iteration", -1)) + 1
            record = {"iteration": iteration, "valid_loss": _scalar(total_loss_dict["lm loss"])}
            # pretrain() evaluates once more after train(), on the same iteration: "final".
            if log.valid and log.valid[-1]["iteration"] == iteration:
                record["final"] = True
            log.valid.append(record)
        return result

    training.evaluate = evaluate_and_record

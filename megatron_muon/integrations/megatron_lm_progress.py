"""The pretrain entry point's progress line and run log, from Megatron-LM's own loop (patches).

``install(log)`` wraps four functions of ``megatron.training.training`` (megatron-core
``SUPPORTED_MEGATRON_CORE``, checked first: ``megatron_lm.check_megatron_core_version``); each
calls the original with the original arguments and returns its result, and only records:

1. ``setup_model_and_optimizer``: the optimizer it returns gets its ``step`` timed (to report the
   optimizer step's share of the training step);
2. ``train_step``: timed (step time, tokens/s, elapsed time);
3. ``training_log``: every iteration, a ``RunLog.train`` record (that iteration's train loss, the
   global batch's token-weighted mean over the data-parallel ranks); after Megatron's own log line,
   a progress bar on rank 0 (when stderr is a terminal) and, every ``--log-interval``, the line
   ``[megatron-muon] iter 10/200 | lr ... | train loss ... | val loss ... | N tokens/s |
   step T ms (optimizer P%) | elapsed 0:12, left 1:40`` (train loss, step time and tokens/s are
   the interval's means; time left extrapolates the mean iteration time since the first step,
   evaluations included);
4. ``evaluate``: a ``RunLog.valid`` record of the validation loss and, on rank 0, the line
   ``[megatron-muon] validation at iter 50: loss ...`` (``final`` for the evaluation
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
    """What the run logged: one record per training iteration, one per evaluation.

    ``train`` records: ``iteration``, ``lr``, ``train_loss``, ``step_ms``, ``tokens_per_s``,
    ``optimizer_share`` (of that step) and ``elapsed_s`` (since the run's first step began);
    ``valid`` records: ``iteration``, ``valid_loss`` and ``final`` (the evaluation after training).
    """

    train: list[dict[str, float]] = field(default_factory=list)
    valid: list[dict[str, float]] = field(default_factory=list)
    # the current step's timings (reset by each record)
    step_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    # wall-clock times (time.perf_counter) of the first step's start and end
    first_step_start: float | None = None
    first_step_end: float | None = None
    records_since_line: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"train": self.train, "valid": self.valid}

    def add_step(self, seconds: float) -> None:
        now = time.perf_counter()
        if self.first_step_start is None:
            self.first_step_start, self.first_step_end = now - seconds, now
        self.step_seconds += seconds

    def add_optimizer(self, seconds: float) -> None:
        self.optimizer_seconds += seconds

    def record_iteration(
        self, iteration: int, lr: float, train_loss: float, tokens_per_step: int
    ) -> None:
        """Appends the iteration's train record; resets the step's timings."""
        now = time.perf_counter()
        step_s = self.step_seconds
        record = {
            "iteration": iteration,
            "lr": lr,
            "train_loss": train_loss,
            "step_ms": 1000.0 * step_s,
            "tokens_per_s": tokens_per_step / step_s if step_s > 0 else 0.0,
            "optimizer_share": self.optimizer_seconds / step_s if step_s > 0 else 0.0,
            "elapsed_s": now - self.first_step_start if self.first_step_start else 0.0,
        }
        self.train.append(record)
        self.step_seconds = self.optimizer_seconds = 0.0
        self.records_since_line += 1

    def take_interval(self) -> list[dict[str, float]]:
        """The train records since the last call (those of one progress line)."""
        interval = self.train[len(self.train) - self.records_since_line :]
        self.records_since_line = 0
        return interval

    def seconds_left(self, iteration: int, total: int) -> float | None:
        """The mean iteration time since the first step ended, times the iterations left."""
        if self.first_step_end is None or len(self.train) < 2:
            return None
        done_since_first = len(self.train) - 1
        per_iteration = (time.perf_counter() - self.first_step_end) / done_since_first
        return per_iteration * max(0, total - iteration)


def _clock(seconds: float | None) -> str:
    """``83.2`` -> ``1:23``; ``None`` -> ``?``."""
    if seconds is None:
        return "?"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}:{rest:02d}"


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


def _print_line_on_rank_0(line: str) -> None:
    """``line`` and its newline on rank 0's stdout in one write. torchrun runs its workers with
    ``python -u``, where ``print`` writes the text and the newline apart, and every rank writes to
    one pipe: another rank's line (Megatron's iteration log, printed by the last rank) could land
    between the two (seen: a progress line with Megatron's log line glued to it)."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def install(log: RunLog) -> None:
    """Records the run into ``log`` and prints the progress lines (module docstring).

    Wraps ``setup_model_and_optimizer``, ``train_step``, ``training_log`` and ``evaluate`` of
    ``megatron.training.training``, once per call: call it once per run, before ``pretrain``.

    Raises:
        RuntimeError: the installed megatron-core is not in ``SUPPORTED_MEGATRON_CORE``.
    """
    check_megatron_core_version(__name__)
    from megatron.training import get_args

    training: Any = importlib.import_module("megatron.training.training")

    setup = training.setup_model_and_optimizer

    def setup_and_time_optimizer(*args: Any, **kwargs: Any) -> Any:
        model, optimizer, scheduler = setup(*args, **kwargs)
        if optimizer is not None:
            optimizer.step = _timed(optimizer.step, log.add_optimizer)
        return model, optimizer, scheduler

    training.setup_model_and_optimizer = setup_and_time_optimizer
    training.train_step = _timed(training.train_step, log.add_step)

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
        if "lm loss" in loss_dict:
            tokens = run_args.global_batch_size * run_args.seq_length
            log.record_iteration(
                iteration, float(learning_rate or 0.0), _scalar(loss_dict["lm loss"]), tokens
            )
        if iteration % run_args.log_interval == 0 and log.records_since_line:
            _print_line_on_rank_0(_progress_line(log, iteration, run_args.train_iters))
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
            # pretrain() evaluates once more after train(): at the iteration of the last
            # periodic evaluation, or off the --eval-interval grid.
            repeated = bool(log.valid) and log.valid[-1]["iteration"] == iteration
            interval = get_args().eval_interval
            if repeated or not interval or iteration % interval != 0:
                record["final"] = True
            log.valid.append(record)
            _print_line_on_rank_0(
                f"[megatron-muon] validation at iter {iteration}: loss "
                f"{record['valid_loss']:.4f}" + (" (final evaluation)" if "final" in record else "")
            )
        return result

    training.evaluate = evaluate_and_record


def _progress_line(log: RunLog, iteration: int, total: int) -> str:
    """The progress line over the records since the last one (module docstring)."""
    interval = log.take_interval()
    last = interval[-1]

    def mean(key: str) -> float:
        return sum(r[key] for r in interval) / len(interval)

    step_s = sum(r["step_ms"] for r in interval) / 1000.0
    optimizer_s = sum(r["optimizer_share"] * r["step_ms"] for r in interval) / 1000.0
    tokens = sum(r["tokens_per_s"] * r["step_ms"] for r in interval) / 1000.0
    tokens_per_s, optimizer_share = (tokens / step_s, optimizer_s / step_s) if step_s else (0, 0)
    last_valid = f"{log.valid[-1]['valid_loss']:.4f}" if log.valid else "-"
    return (
        f"[megatron-muon] iter {iteration}/{total} | lr {last['lr']:.3e} | "
        f"train loss {mean('train_loss'):.4f} | val loss {last_valid} | "
        f"{tokens_per_s:,.0f} tokens/s | step {mean('step_ms'):.1f} ms "
        f"(optimizer {100 * optimizer_share:.0f}%) | "
        f"elapsed {_clock(last['elapsed_s'])}, left {_clock(log.seconds_left(iteration, total))}"
    )

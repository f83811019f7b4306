"""``make demo``: the same small GPT trained twice on real text, with Muon and with AdamW.

Both runs go through the project's one training loop (``python -m megatron_muon.pretrain``, i.e.
Megatron-LM's ``pretrain`` after ``integrations.megatron_lm.install()``) on 2 ranks with
Megatron-FSDP (``optim_grads_params``), from the same initialization (same ``--seed``) and on the
same embedded data (byte tokens of the Python standard library's sources in a seeded random
order; validation on the same held-out sequences at every evaluation). Only ``--optimizer`` and
the learning rate differ. The run's shape is ``configs/tiny-cpu.yaml``'s (200 iterations,
evaluation every 20).

Fair learning rates: each optimizer's peak LR is the best of a sweep on the demo's own config
(the table: docs/megatron-fsdp-measurements.md); the schedule (10 warm-up iterations, cosine
decay to LR/10) is the same for both.

While each run trains, its progress lines (iteration, train loss, last validation loss, elapsed
and remaining time) and validation losses are echoed; the rest of its output goes to its log.
Outputs, under ``--out`` (``demo_out/``): each run's console log and JSON log (a train loss for
every iteration, a validation loss for every evaluation), ``summary.json`` and ``loss.png``
(``megatron_muon.cli.loss_plot``: both runs on the same axes, with the final figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from megatron_muon.cli.loss_plot import SMOOTHING_WINDOW, final_figures, plot_loss_curves

__all__ = ["main", "DEMO_RUNS", "echo_progress"]

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml"
# optimizer -> peak learning rate (the best of the sweep, docs/megatron-fsdp-measurements.md)
DEMO_RUNS = {"muon": 0.005, "adam": 0.0015}
LABELS = {"muon": "Muon", "adam": "AdamW"}


# Lines of the child's rank 0 that the demo echoes while it trains (megatron_lm_progress).
PROGRESS_PREFIX = "[megatron-muon] "
ECHOED = ("iter ", "validation at iter ")
DATA_LINE = "> byte-level data: "  # what the run trains on, printed just before training
# The run's shape, from the config unless given (a shorter demo: tests/test_demo.py).
RUN_SHAPE_FLAGS = ("--train-iters", "--eval-interval", "--eval-iters", "--log-interval")


def _command(optimizer: str, lr: float, log_json: Path, args: argparse.Namespace) -> list[str]:
    """The torchrun command line of one run (only ``--optimizer`` and the LR differ)."""
    command = [
        sys.executable,
        *("-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}"),
        *("-m", "megatron_muon.pretrain", "--config", str(args.config)),
        *("--optimizer", optimizer, "--lr", f"{lr:g}", "--min-lr", f"{lr / 10:g}"),
        *("--seed", str(args.seed), "--log-json", str(log_json)),
        *(args.muon_flags if optimizer == "muon" else []),
    ]
    for flag in RUN_SHAPE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            command += [flag, str(value)]
    return command


def echo_progress(line: str, name: str) -> str | None:
    """The console line for one line of the child's output: its progress and validation lines
    (``[megatron-muon] iter ...``, ``[megatron-muon] validation at iter ...``) and its data line
    (``> byte-level data: ...``), else None."""
    text = line.rstrip()
    _, found, rest = text.partition(PROGRESS_PREFIX)
    if found and rest.startswith(ECHOED):
        return f"  {name:>6} | {rest}"
    if text.startswith(DATA_LINE):
        return f"  {name:>6} | {text[2:]}"
    return None


def _run(optimizer: str, lr: float, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Trains one run through torchrun, echoing its progress; returns its JSON log plus wall
    time. The child's whole output goes to ``out/<optimizer>.log``."""
    log_json, log_path = out / f"{optimizer}.json", out / f"{optimizer}.log"
    command = _command(optimizer, lr, log_json, args)
    print(f"[demo] {optimizer}: {' '.join(command[2:])}", flush=True)
    print(f"[demo] {optimizer}: starting {args.nproc} ranks, full log: {log_path}", flush=True)
    start = time.perf_counter()
    # TORCHDYNAMO_DISABLE: Megatron's initialization warms up its torch.compile'd bias-GeLU and
    # bias-dropout-add fusions even when the run turns them off (--no-bias-*-fusion, as the CPU
    # defaults do); compiling them made Megatron's initialization take 27.5 s instead of 0.9 s
    # on a 2-core CPU. Nothing else in these runs is compiled.
    # Both ranks write to one pipe, unbuffered (torchrun runs its workers with python -u): the
    # progress lines echoed here are written whole, each in one write
    # (integrations.megatron_lm_progress), so no other rank's output lands inside one.
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
    with open(log_path, "w") as console:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        assert process.stdout is not None  # stdout=PIPE
        for line in process.stdout:
            console.write(line)
            echoed = echo_progress(line, optimizer)
            if echoed:
                print(echoed, flush=True)
        returncode = process.wait()
    seconds = time.perf_counter() - start
    if returncode != 0 or not log_json.exists():
        tail = log_path.read_text().splitlines()[-30:]
        raise RuntimeError(
            f"the {optimizer} run failed (exit code {returncode}); last lines of "
            f"{log_path}:\n" + "\n".join(tail)
        )
    record = json.loads(log_json.read_text())
    record["wall_seconds"] = seconds
    record["lr"] = lr
    fixed = re.search(r"each evaluation reads the same (\d+) validation", log_path.read_text())
    record["valid_sequences"] = int(fixed.group(1)) if fixed else None
    print(f"[demo] {optimizer}: done in {seconds:.0f} s", flush=True)
    return record


def _muon_precision_flags() -> list[str]:
    """``FP32_NS_FLAGS`` (``--muon-fp32-matmul-prec high``) where bf16 matmuls are slow on this
    CPU (said once, with the rates); none elsewhere (Megatron's default, bf16 NS). The demo shows
    Muon against AdamW, not how slowly a CPU emulates bf16; a training run keeps Megatron's default
    and is told (``megatron_muon.pretrain``)."""
    import torch

    from megatron_muon.newton_schulz.matmul_rates import (
        FP32_NS_FLAGS,
        bf16_is_slow,
        measure_matmul_rates,
        slow_bf16_message,
    )

    if torch.cuda.is_available():
        return []
    rates = measure_matmul_rates()
    if not bf16_is_slow(rates):
        return []
    print(f"[demo] {slow_bf16_message(rates)} The demo passes it.", flush=True)
    return list(FP32_NS_FLAGS)


def _summary(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per run: final figures (``loss_plot.final_figures``), the median step's throughput, the
    optimizer's share of the step time, wall time."""
    summary = {}
    for optimizer, record in runs.items():
        train = record["train"]
        # the median step: the first steps include compilation and warm-up
        step_ms = statistics.median(r["step_ms"] for r in train)
        share = sum(r["optimizer_share"] * r["step_ms"] for r in train)
        summary[optimizer] = {
            "lr": record["lr"],
            **final_figures(record),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train),
            "step_ms": step_ms,
            "optimizer_share": share / sum(r["step_ms"] for r in train),
            "wall_seconds": record["wall_seconds"],
        }
    return summary


def _print_table(summary: dict[str, dict[str, float]]) -> None:
    rows = [
        ("peak lr", "lr", "{:.3g}"),
        ("iterations", "final_iteration", "{:.0f}"),
        (f"train loss (last {SMOOTHING_WINDOW} it.)", "final_train_loss", "{:.4f}"),
        ("final validation loss", "final_valid_loss", "{:.4f}"),
        ("tokens/s (median step)", "tokens_per_s", "{:.0f}"),
        ("step time (ms, median)", "step_ms", "{:.0f}"),
        ("optimizer share of step", "optimizer_share", "{:.1%}"),
        ("wall time (s)", "wall_seconds", "{:.0f}"),
    ]
    names = [LABELS.get(name, name) for name in summary]
    print(f"\n{'':26}" + "".join(f"{name:>14}" for name in names))
    for label, key, fmt in rows:
        print(f"{label:26}" + "".join(f"{fmt.format(s[key]):>14}" for s in summary.values()))


def _plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    sequences = runs["muon"].get("valid_sequences")
    plot_loss_curves(
        {LABELS.get(name, name): run for name, run in runs.items()},
        path,
        title="Tiny GPT on Python stdlib sources (bytes), 2 CPU ranks, Megatron-FSDP",
        details={LABELS.get(name, name): f"peak lr {run['lr']:g}" for name, run in runs.items()},
        validation_label=(
            f"validation loss, same {sequences} held-out sequences"
            if sequences
            else "validation loss, same held-out sequences"
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    parser.add_argument("--config", type=Path, default=CONFIG)
    for flag in RUN_SHAPE_FLAGS:
        parser.add_argument(flag, type=int, default=None, help="default: the config's")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if not args.config.exists():
        raise FileNotFoundError(f"demo config {args.config} does not exist")
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.muon_flags = _muon_precision_flags()
    runs = {name: _run(name, lr, args.out, args) for name, lr in DEMO_RUNS.items()}
    summary = _summary(runs)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_table(summary)
    plot_path = args.out / "loss.png"
    _plot(runs, plot_path)
    muon, adam = summary["muon"]["final_valid_loss"], summary["adam"]["final_valid_loss"]
    verdict = "below" if muon < adam else "NOT below"
    print(f"\nMuon's final validation loss {muon:.4f} is {verdict} AdamW's {adam:.4f}.")
    print(f"Loss curves: {plot_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

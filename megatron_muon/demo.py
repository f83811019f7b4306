"""``make demo``: the same small GPT trained twice on real text, with Muon and with AdamW.

Both runs go through the project's one training loop (``python -m megatron_muon.pretrain``, i.e.
Megatron-LM's ``pretrain`` after ``integrations.megatron_lm.install()``) on 2 ranks with
Megatron-FSDP (``optim_grads_params``), from the same initialization (same ``--seed``) and on the
same embedded data (byte tokens of the Python standard library's sources, held-out validation
split). Only ``--optimizer`` and the learning rate differ.

Fair learning rates: each optimizer's peak LR is the best of a sweep on 100 iterations of the same
config (the table: docs/megatron-fsdp-measurements.md); the schedule (10 warm-up iterations, cosine
decay to LR/10) is the same for both.

Outputs, under ``--out`` (``demo_out/``): each run's console log and JSON log, ``summary.json`` and
``loss.png`` (train and validation loss of both runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "DEMO_RUNS"]

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml"
# optimizer -> peak learning rate (the best of the sweep, docs/megatron-fsdp-measurements.md)
DEMO_RUNS = {"muon": 0.003, "adam": 0.01}


def _run(optimizer: str, lr: float, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Trains one run through torchrun; returns its JSON log plus wall time."""
    log_json = out / f"{optimizer}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={args.nproc}",
        "-m",
        "megatron_muon.pretrain",
        "--config",
        str(args.config),
        "--optimizer",
        optimizer,
        "--lr",
        str(lr),
        "--min-lr",
        str(lr / 10),
        "--seed",
        str(args.seed),
        "--train-iters",
        str(args.train_iters),
        "--eval-iters",
        str(args.eval_iters),
        "--log-json",
        str(log_json),
        *(args.muon_flags if optimizer == "muon" else []),
    ]
    print(f"[demo] {optimizer}: {' '.join(command[2:])}", flush=True)
    start = time.perf_counter()
    with open(out / f"{optimizer}.log", "w") as console:
        process = subprocess.run(command, stdout=console, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - start
    if process.returncode != 0 or not log_json.exists():
        tail = (out / f"{optimizer}.log").read_text().splitlines()[-30:]
        raise RuntimeError(
            f"the {optimizer} run failed (exit code {process.returncode}); last lines of "
            f"{out / f'{optimizer}.log'}:\n" + "\n".join(tail)
        )
    record = json.loads(log_json.read_text())
    record["wall_seconds"] = seconds
    record["lr"] = lr
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
    summary = {}
    for optimizer, record in runs.items():
        train, valid = record["train"], record["valid"]
        steady = train[1:] or train  # the first logged interval includes warm-up and compilation
        summary[optimizer] = {
            "lr": record["lr"],
            "final_iteration": train[-1]["iteration"],
            "final_train_loss": train[-1]["train_loss"],
            "final_valid_loss": valid[-1]["valid_loss"],
            "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
            "step_ms": sum(r["step_ms"] for r in steady) / len(steady),
            "optimizer_share": sum(r["optimizer_share"] for r in steady) / len(steady),
            "wall_seconds": record["wall_seconds"],
        }
    return summary


def _print_table(summary: dict[str, dict[str, float]]) -> None:
    rows = [
        ("peak lr", "lr", "{:.3g}"),
        ("iterations", "final_iteration", "{:.0f}"),
        ("final train loss", "final_train_loss", "{:.4f}"),
        ("final validation loss", "final_valid_loss", "{:.4f}"),
        ("tokens/s", "tokens_per_s", "{:.0f}"),
        ("step time (ms)", "step_ms", "{:.0f}"),
        ("optimizer share of step", "optimizer_share", "{:.1%}"),
        ("wall time (s)", "wall_seconds", "{:.0f}"),
    ]
    names = list(summary)
    print(f"\n{'':26}" + "".join(f"{name:>14}" for name in names))
    for label, key, fmt in rows:
        print(f"{label:26}" + "".join(f"{fmt.format(summary[n][key]):>14}" for n in names))


def _plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    colors = {"muon": "tab:red", "adam": "tab:blue"}
    labels = {"muon": "Muon (megatron-muon ShardedMuon)", "adam": "AdamW"}
    for optimizer, record in runs.items():
        color = colors.get(optimizer)
        label = labels.get(optimizer, optimizer)
        axis.plot(
            [r["iteration"] for r in record["train"]],
            [r["train_loss"] for r in record["train"]],
            color=color,
            label=f"{label}: train",
        )
        axis.plot(
            [r["iteration"] for r in record["valid"]],
            [r["valid_loss"] for r in record["valid"]],
            color=color,
            linestyle="--",
            marker="o",
            label=f"{label}: validation",
        )
    axis.set_xlabel("iteration")
    axis.set_ylabel("cross-entropy loss (nats per byte)")
    axis.set_title("Tiny GPT on Python stdlib sources, 2 CPU ranks, Megatron-FSDP")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--train-iters", type=int, default=200)
    # Validation files differ a lot in predictability: 20 batches per evaluation keep the curve
    # from following which files a 4-batch evaluation happens to draw.
    parser.add_argument("--eval-iters", type=int, default=20)
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

"""Every emerging optimizer we run on Megatron-FSDP: its optimizer step at DP = 1, 2, 4, next to
megatron-core's own optimizer at DP=1.

The optimizers are the values of ``megatron_muon.common.options.FsdpOptimizerT`` (muon,
adaptive_muon, lion, ...: what ``build_muon_optimizer`` builds), so a new one enters the section
by appearing there. For each, on the bench GPT (``BenchConfig.gpt``: a megatron-core ``GPTModel``
under megatron-core's ``FullyShardedDataParallel``, ``optim_grads_params``; fp32; Megatron's
defaults, clip 1.0, the run's NS precision):

- **ours**: ``build_muon_optimizer`` (``benchmarks.training_step.Trainer``), one launch per DP
  size; one forward and backward, then the timed steps, each ``optimizer.step()`` of the step
  wrapper (grad norm, clipping, every sub-optimizer, the install of the new weights into the
  compute weights), on the same grads. The GPT computes in fp32 on the CPU, so Megatron-FSDP keeps
  no second fp32 copy of its weights for the optimizer (``main_params_dtype``: None, Megatron-LM's
  ``--megatron-fsdp-main-params-dtype auto``), as the stock keeps none: with the copy (Megatron's
  default fp32) each step also copies every weight into the compute weights, 14 ms of Lion's
  ~90 ms step on the bench GPT (profiled), which the stock does not do. The params after a step
  are bitwise the same either way (measured once: muon and lion at DP=1 and 2, soap at DP=2, 3
  steps of the tiny GPT);
- **stock** (DP=1 only, in the same process, stepped in turn with ours): megatron-core's
  ``get_megatron_optimizer`` with the same ``OptimizerConfig`` on the same ``GPTModel``
  unwrapped, one rank: its ``ChainedOptimizer`` of the stock class (``TensorParallelMuon``,
  ``TensorParallelAdaptiveMuon``, ``Lion``, ...) and AdamW on full tensors. ``adaptive_muon``'s
  stock class has its crash fixed and ``lion``'s reads the Lion betas (the fixes ``install()``
  applies: ``integrations.adaptive_muon_fix``, ``integrations.stock_lion``).

Every time is ``benchmarks.optimizer_step.time_alternating``'s: the median of ``repeats`` steps
after ``warmup``, each between barriers, the slowest rank's. Per optimizer: ours / stock at DP=1
(target <= 1.05), the DP=1 / DP=2 speed-up, and at DP=4 the largest per-rank optimizer-state bytes
over the mean over ranks (every tensor in every sub-optimizer's state, the local part of a
DTensor; target <= 1.15 for soap, issue 37). An optimizer that ours or the stock cannot build is
reported with the error, not timed.
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
from dataclasses import asdict
from typing import Any, get_args

import torch

from benchmarks.launcher import run_ranks
from benchmarks.models import GPTSize
from benchmarks.optimizer_step import time_alternating
from benchmarks.section import RunContext, Section
from benchmarks.tables import mib, table
from benchmarks.training_step import Trainer, build_gpt, gpt_batch, optimizer_config

__all__ = ["DP_SIZES", "SECTION", "TARGETS", "fsdp_optimizers_section", "optimizer_names"]

DP_SIZES = (1, 2, 4)
# figure -> (what it is, target as (comparison, bound), the optimizers it is judged for: None = all)
TARGETS: dict[str, tuple[str, tuple[str, float], tuple[str, ...] | None]] = {
    "ours_over_stock_dp1": ("optimizer step, ours / megatron-core's own, DP=1", ("<=", 1.05), None),
    "state_max_over_mean_dp4": (
        "optimizer state, largest rank / mean, DP=4",
        ("<=", 1.15),
        ("soap",),
    ),
}


def optimizer_names() -> tuple[str, ...]:
    """The optimizers ``build_muon_optimizer`` builds for Megatron-FSDP, in their order."""
    from megatron_muon.common.options import FsdpOptimizerT

    return get_args(FsdpOptimizerT)


def _error(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def _class_names(optimizer: Any) -> list[str]:
    """The torch optimizer classes under a megatron-core (or our) chained optimizer."""
    chained = getattr(optimizer, "inner", optimizer).chained_optimizers
    return [type(child.optimizer).__name__ for child in chained]


def state_bytes(optimizer: Any) -> int:
    """This rank's optimizer-state bytes: every tensor in each sub-optimizer's ``state`` (the
    local part of a DTensor: the rows this rank holds)."""
    from torch.utils._pytree import tree_leaves

    from megatron_muon.engine.layout import local_tensor

    total = 0
    for child in getattr(optimizer, "inner", optimizer).chained_optimizers:
        for leaf in tree_leaves(list(child.optimizer.state.values())):
            if isinstance(leaf, torch.Tensor):
                local = local_tensor(leaf)
                total += local.numel() * local.element_size()
    return total


class _StockTrainer:
    """megatron-core's own optimizer for ``name`` on the bench GPT, unwrapped, one rank, with one
    forward and backward's grads in ``param.grad``."""

    def __init__(self, size: GPTSize, device: str, name: str) -> None:
        from megatron.core.optimizer import get_megatron_optimizer

        _, model = build_gpt(size, device, bf16=False)
        self.optimizer = get_megatron_optimizer(optimizer_config(name, bf16=False), [model])
        model.zero_grad()
        model(**gpt_batch(size, device)).float().mean().backward()


def main_params_dtype(device: str) -> torch.dtype | None:
    """Megatron-FSDP's main-weight dtype for ours: None (the compute weights are the main weights)
    where the GPT computes in fp32 (CPU), as the unwrapped stock steps its fp32 weights in place;
    fp32 beside bf16 compute weights (CUDA)."""
    return None if device == "cpu" else torch.float32


def _install_stock_fixes() -> None:
    """What ``megatron_lm.install()`` does to megatron-core's stock emerging optimizers."""
    from megatron_muon.integrations import adaptive_muon_fix, stock_lion

    adaptive_muon_fix.install()
    stock_lion.patch()


def optimizer_steps(
    rank: int,
    world_size: int,
    device: str,
    size: GPTSize,
    names: tuple[str, ...],
    warmup: int,
    repeats: int,
    eager: bool,
) -> dict[str, dict]:
    """Rank body: each of ``names`` on the Megatron-FSDP bench GPT at this DP size (and the stock
    optimizer beside it at DP=1), one after the other; ``eager``: torch.compile'd code (Lion's
    update) runs uncompiled.

    Returns:
        ``{name: {"seconds", "state_bytes", "ours_classes", ...}}``, at DP=1 also
        ``"stock_seconds"`` and ``"stock_classes"``; ``{name: {"error": ...}}`` for an optimizer
        ours or the stock could not build.
    """
    if world_size == 1:
        _install_stock_fixes()
    stance = torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()
    with stance:
        return _optimizer_steps(world_size, device, size, names, warmup, repeats)


def _optimizer_steps(
    world_size: int, device: str, size: GPTSize, names: tuple[str, ...], warmup: int, repeats: int
) -> dict[str, dict]:
    figures: dict[str, dict] = {}
    for name in names:
        # Without the factory's build summary (rank 0), which would repeat per optimizer and
        # launch: the classes built are reported instead.
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                trainer = Trainer(size, world_size, device, name, main_params_dtype(device))
                stock = _StockTrainer(size, device, name) if world_size == 1 else None
        except Exception as error:  # reported by name, not timed (the module docstring)
            figures[name] = {"error": _error(error)}
            continue
        trainer.forward_backward()
        optimizers = {"ours": trainer.optimizer}
        if stock is not None:
            optimizers["stock"] = stock.optimizer
        seconds = time_alternating(optimizers, device, warmup, repeats)
        figures[name] = {
            "seconds": seconds["ours"],
            "state_bytes": state_bytes(trainer.optimizer),
            "ours_classes": _class_names(trainer.optimizer),
        }
        if stock is not None:
            figures[name] |= {
                "stock_seconds": seconds["stock"],
                "stock_classes": _class_names(stock.optimizer),
            }
        del trainer, stock, optimizers
    return figures


def _verdict(value: float, target: tuple[str, float]) -> bool:
    op, bound = target
    return value <= bound if op == "<=" else value >= bound


def _combine(name: str, by_dp: dict[int, list[dict]]) -> dict:
    """One optimizer's figures from every launch's ranks (the slowest rank's time)."""
    seconds = {str(dp): max(r[name]["seconds"] for r in ranks) for dp, ranks in by_dp.items()}
    (dp1,) = by_dp[1]
    state = [r[name]["state_bytes"] for r in by_dp[4]]
    entry = {
        "ours_classes": dp1[name]["ours_classes"],
        "stock_classes": dp1[name]["stock_classes"],
        "seconds_by_dp": seconds,
        "stock_s": dp1[name]["stock_seconds"],
        "ours_over_stock_dp1": seconds["1"] / dp1[name]["stock_seconds"],
        "dp1_over_dp2": seconds["1"] / seconds["2"],
        "state_bytes_dp4": state,
        "state_max_over_mean_dp4": max(state) / statistics.fmean(state) if any(state) else 1.0,
    }
    entry["holds"] = {
        figure: _verdict(entry[figure], target)
        for figure, (_, target, judged) in TARGETS.items()
        if judged is None or name in judged
    }
    return entry


def fsdp_optimizers_section(
    size: GPTSize, device: str, warmup: int, repeats: int, eager: bool = False
) -> dict:
    """Every ``optimizer_names()`` optimizer at ``DP_SIZES`` (module docstring); ``eager``:
    torch.compile'd code runs uncompiled (``--quick``: compiling Lion's update took 38 s in one
    process from a cold Inductor cache on a shared 2-core machine, 7 s warm: most of the smoke
    run's time)."""
    names = optimizer_names()
    load_before = os.getloadavg()
    by_dp = {
        dp: run_ranks(optimizer_steps, dp, device, size, names, warmup, repeats, eager)
        for dp in DP_SIZES
    }
    load_after = os.getloadavg()
    by_optimizer, not_built = {}, {}
    for name in names:
        # The same build error at every DP size is said once, with the sizes.
        errors: dict[str, list[int]] = {}
        for dp, ranks in by_dp.items():
            error = next((r[name]["error"] for r in ranks if "error" in r[name]), None)
            if error is not None:
                errors.setdefault(error, []).append(dp)
        if errors:
            not_built[name] = "; ".join(f"DP={dps}: {error}" for error, dps in errors.items())
        else:
            by_optimizer[name] = _combine(name, by_dp)
    return {
        "model": asdict(size),
        "strategy": "optim_grads_params",
        "dp_sizes": list(DP_SIZES),
        "optimizers": list(names),
        "compiled": not eager,
        "by_optimizer": by_optimizer,
        "not_built": not_built,
        "targets": {
            figure: {"label": label, "target": list(target), "judged_for": judged}
            for figure, (label, target, judged) in TARGETS.items()
        },
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
    }


def _judged(entry: dict, figure: str, digits: int = 3) -> str:
    value = f"{entry[figure]:.{digits}f}"
    if figure not in entry["holds"]:
        return value
    return f"**{value}** ({'holds' if entry['holds'][figure] else 'does not hold'})"


def format_section(section: dict) -> list[str]:
    """The section as Markdown lines."""
    model = section["model"]
    before = ", ".join(f"{x:.2f}" for x in section["load_average_before"])
    after = ", ".join(f"{x:.2f}" for x in section["load_average_after"])
    targets = "; ".join(
        f"{t['label']} {t['target'][0]} {t['target'][1]}"
        + (f" ({', '.join(t['judged_for'])})" if t["judged_for"] else "")
        for t in section["targets"].values()
    )
    lines = [
        f"**Every emerging optimizer on Megatron-FSDP** (GPTModel {model['num_layers']} layers, "
        f"hidden {model['hidden']}, FFN {model['ffn_hidden']}, vocab {model['vocab_size']}; "
        f"{section['strategy']}; optimizer step s; load average before {before}, after {after}; "
        f"targets: {targets})",
        "",
    ]
    rows = []
    for name, e in section["by_optimizer"].items():
        s = e["seconds_by_dp"]
        rows.append(
            [
                name,
                f"{s['1']:.3f}",
                f"{e['stock_s']:.3f}",
                _judged(e, "ours_over_stock_dp1"),
                f"{s['2']:.3f}",
                f"{s['4']:.3f}",
                f"{e['dp1_over_dp2']:.2f}",
                f"{mib(max(e['state_bytes_dp4']))} / {mib(statistics.fmean(e['state_bytes_dp4']))}",
                _judged(e, "state_max_over_mean_dp4"),
            ]
        )
    lines += table(
        [
            "optimizer",
            "ours DP=1",
            "stock DP=1",
            "ours / stock",
            "ours DP=2",
            "ours DP=4",
            "DP=1 / DP=2",
            "state DP=4, max / mean",
            "state max / mean",
        ],
        rows,
    )
    for name, e in section["by_optimizer"].items():
        lines.append(
            f"- {name}: ours {' + '.join(e['ours_classes'])}; "
            f"stock {' + '.join(e['stock_classes'])}"
        )
    for name, reason in section["not_built"].items():
        lines.append(f"- {name}: not built, not timed ({reason})")
    return lines


def _run(context: RunContext, results: dict) -> dict:
    config = context.config
    return fsdp_optimizers_section(
        config.gpt, context.device, config.warmup, config.repeats, eager=context.quick
    )


def _lines(results: dict) -> list[str]:
    return [*format_section(results["fsdp_optimizers"]), ""]


SECTION = Section(
    key="fsdp_optimizers",
    run=_run,
    figures=tuple(
        f"fsdp_optimizers.by_optimizer.*.{figure}"
        for figure in (
            "seconds_by_dp",
            "stock_s",
            "ours_over_stock_dp1",
            "dp1_over_dp2",
            "state_max_over_mean_dp4",
        )
    ),
    report=_lines,
    markdown=_lines,
)

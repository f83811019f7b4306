"""A Megatron-DDP run (``torch_dist``) converted to Megatron-FSDP (``fsdp_dtensor``) continues as
it would have, and back (``python -m megatron_muon.convert``).

Four launches of Megatron-LM's loop (``tests/torchrun.py``; the tiny GPT, 2 CPU ranks, stock Adam),
shared by both tests:

- ``stock``: megatron-core's DDP with the distributed optimizer (``--ckpt-format torch_dist
  --dist-ckpt-optim-fully-reshardable``), 8 iterations at DP = 2, saving at 4 (and 8): the
  reference, the run continued at its own layout (a resume there is bitwise it:
  ``integrations.distributed_optimizer_resume`` says why it was not before);
- ``floor``: the same stock run resumed from its iteration-4 save at DP = 1: what a layout change
  alone (another reduction order) makes of iterations 5 to 8;
- ``fsdp``: the iteration-4 save converted to ``fsdp_dtensor`` and continued on Megatron-FSDP at
  DP = 2 (``install()``: stock Adam with its state on every rank), saving at 6;
- ``stock_back``: that iteration-6 save converted back to ``torch_dist`` and continued on stock DDP.

A floor-judged comparison (``tests/run_comparison.py``; docs/testing.md): each continuation's
printed losses and full-precision grad norms against the reference's, within ``FLOOR_FACTOR``
times the envelope of the ``floor`` run's differences from the same reference (a layout change
alone: DDP and Megatron-FSDP reduce in other orders, as DP = 1 and DP = 2 do). Measured on 2 CPU
cores: both conversions within 1.2 floors (grad norms 2.0e-7 against a floor of 1.7e-7); a wrong
Adam state moves the next grad norm by 1e-2 (the shared step tensor of the stand-in's docstring,
1.1e-2). Why Adam's ``--adam-eps 1e-3``: at the default 1e-8, elements whose second moment is near
zero step by about the lr whatever the sign of a last-bit gradient difference, and a layout change
alone moved the grad norm of iteration 8 by 10% (measured: DP = 1 against DP = 2, 2.3156 against
2.1016), a floor under which a wrong state would pass; at 1e-3 the floor is 1.7e-7.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_muon.convert import convert
from tests.run_comparison import (
    FULL_PRECISION_GUARD,
    PRINTED_GUARD,
    assert_within_floor,
    grad_norms,
    losses,
    resumed_expectations,
)
from tests.torchrun import REPO, MegatronRun, run_megatron

pytestmark = [pytest.mark.timeout(900), pytest.mark.multirank]

NUM_ITERS, SAVE_AT, BACK_AT = 8, 4, 6
ADAM = [*"--optimizer adam --lr 0.001 --adam-eps 1e-3".split(), "--train-iters", str(NUM_ITERS)]
STOCK = "--use-distributed-optimizer --ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable"
FSDP = "--data-parallel-sharding-strategy optim_grads_params"


def _load(directory: Path, iteration: int) -> list[str]:
    return ["--load", str(directory), "--ckpt-step", str(iteration), "--no-load-rng"]


def _convert(source_format: str, source: Path, target: Path) -> str:
    """``python -m megatron_muon.convert``, as a user runs it; its output."""
    command = [sys.executable, "-m", "megatron_muon.convert", "--from", source_format]
    done = subprocess.run(
        [*command, str(source), str(target)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


class Runs:
    """The four launches and two conversions (module docstring)."""

    def __init__(self, root: Path) -> None:
        start = time.monotonic()
        save = ["--save", str(root / "stock"), "--save-interval", str(SAVE_AT)]
        stock = [*ADAM, *STOCK.split()]
        self.stock = run_megatron([*stock, *save], megatron_fsdp=False, timeout=300)
        self.floor = run_megatron(
            [*stock, *_load(root / "stock", SAVE_AT)], nproc=1, megatron_fsdp=False, timeout=300
        )
        self.to_fsdp = _convert("torch_dist", root / "stock" / f"iter_{SAVE_AT:07d}", root / "in")
        resave = ["--save", str(root / "fsdp"), "--save-interval", str(BACK_AT - SAVE_AT)]
        self.fsdp = run_megatron([*ADAM, *FSDP.split(), *_load(root / "in", SAVE_AT), *resave])
        back = root / "fsdp" / f"iter_{BACK_AT:07d}"
        # In process (the command line ran above): one torch import fewer.
        summary = convert("fsdp_dtensor", str(back), str(root / "back"), progress=lambda _: None)
        self.to_stock = "\n".join(summary.lines())
        self.stock_back = run_megatron(
            [*stock, *_load(root / "back", BACK_AT)], megatron_fsdp=False, timeout=300
        )
        self.wall_s = time.monotonic() - start


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("convert"))


def assert_continues(label: str, run: MegatronRun, runs: Runs, start: int) -> None:
    """``run``, loaded at iteration ``start``, against the stock run continued at its own layout
    (``runs.stock``, iterations ``start + 1`` on): printed losses and full-precision grad norms
    each within the floor of ``runs.floor`` (the same stock run resumed at DP = 1) against it
    (``tests/run_comparison.py``; the second line after a start is the mean of two iterations'
    losses: ``resumed_expectations``)."""
    assert sorted(run.iterations) == list(range(start + 1, NUM_ITERS + 1))
    norms, expected = resumed_expectations(run, runs.stock)
    floor_norms, floor_losses = resumed_expectations(runs.floor, runs.stock)
    for what, values, reference, floor, floor_reference, guard in (
        ("lm loss", losses(run), expected, losses(runs.floor), floor_losses, PRINTED_GUARD),
        (
            "grad norm",
            grad_norms(run),
            norms,
            grad_norms(runs.floor),
            floor_norms,
            FULL_PRECISION_GUARD,
        ),
    ):
        assert_within_floor(
            f"{label} {what}",
            values,
            reference,
            floor,
            floor_reference=floor_reference,
            guard=guard,
        )


def test_a_megatron_ddp_adam_run_converted_continues_on_megatron_fsdp_within_the_layout_floor(
    runs: Runs,
) -> None:
    launches = [runs.stock, runs.floor, runs.fsdp, runs.stock_back]
    print(
        f"\nfour launches and two conversions in {runs.wall_s:.0f} s (launches "
        f"{[round(run.wall_s) for run in launches]} s)\n{runs.to_fsdp}"
    )
    assert "optimizer states carried: 84" in runs.to_fsdp  # 28 params: exp_avg, exp_avg_sq, step
    # Megatron-FSDP shards rows over the 2 ranks; megatron-core's DDP holds every param whole.
    assert any(local < rows for local, rows in runs.fsdp.layouts[0].values())
    assert all(local == rows for local, rows in runs.stock.layouts[0].values())
    assert_continues("torch_dist -> fsdp_dtensor", runs.fsdp, runs, SAVE_AT)


def test_a_megatron_fsdp_run_converted_back_continues_on_stock_ddp_within_the_layout_floor(
    runs: Runs,
) -> None:
    print(f"\n{runs.to_stock}")
    assert_continues("fsdp_dtensor -> torch_dist", runs.stock_back, runs, BACK_AT)

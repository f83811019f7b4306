"""A Megatron-DDP run (``torch_dist``) converted to Megatron-FSDP (``fsdp_dtensor``) continues as
it would have, and back (``python -m megatron_muon.convert``): with Adam, and with megatron-core's
own Muon (``LayerWiseDistributedOptimizer``) against ours.

Adam: four launches of Megatron-LM's loop (``tests/torchrun.py``; the tiny GPT, 2 CPU ranks, stock
Adam), shared by the first two tests:

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

Muon: four more launches (``muon_runs``), the same shape: ``stock`` is megatron-core's Muon under
``LayerWiseDistributedOptimizer`` (``--optimizer muon --use-distributed-optimizer --ckpt-format
torch_dist``) at TP = 2 x DP = 2 on 4 ranks (each DP rank steps and saves the state of its own
params; fp32, which needs ``integrations.layer_wise_fp32``, and on gloo
``cpu_stand_ins.uneven_collectives``), ``floor`` is ``tests.run_comparison.floor_run`` of the stock
run resumed from its iteration-4 save (every weight one ulp up: a last-bit perturbation grown by
the same Muon), ``fsdp`` is ours on Megatron-FSDP at TP = 1 x DP = 2 from the converted save,
``stock_back`` is stock LayerWise at TP = 2 x DP = 2 again from ours converted back. Like-for-like
flags (``tests/stock_parity.py`` says why): ``--position-embedding-type rope`` (megatron-core's Muon
orthogonalizes a learned position embedding, ours runs it on AdamW: the converter refuses it), fp32
Newton-Schulz (``--muon-fp32-matmul-prec high``), and ``MUON_TP2``'s (each matrix orthogonalized
whole at TP = 2, the vocabulary padded as at TP = 1).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_muon.convert import convert
from tests.run_comparison import (
    FULL_PRECISION_GUARD,
    PRINTED_GUARD,
    assert_within_floor,
    floor_run,
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
MUON = [
    *"--optimizer muon --lr 0.02 --muon-fp32-matmul-prec high".split(),
    *"--position-embedding-type rope --train-iters".split(),
    str(NUM_ITERS),
]
# megatron-core's Muon: --use-distributed-optimizer is LayerWiseDistributedOptimizer (its state is
# model space whatever --dist-ckpt-optim-fully-reshardable says).
STOCK_MUON = "--use-distributed-optimizer --ckpt-format torch_dist"
# Its TP = 2 (with the variable Megatron asserts for TP): each matrix orthogonalized whole
# (duplicated: gathered over TP, the NS of TP = 1; blockwise would orthogonalize each TP shard
# apart, another update than ours at TP = 1), the vocabulary padded as at TP = 1 (last two flags).
MUON_TP2 = [
    *"--tensor-model-parallel-size 2 --muon-tp-mode duplicated".split(),
    *"--megatron-muon-setenv CUDA_DEVICE_MAX_CONNECTIONS=1".split(),
    *"--make-vocab-size-divisible-by 64".split(),
]


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
    """The four launches and two conversions (module docstring): ``stock`` saved at ``SAVE_AT``,
    ``floor`` from that save, ``fsdp`` from it converted (saving at ``BACK_AT``), ``stock_back``
    from that converted back."""

    def __init__(
        self, root: Path, stock: list[str], ours: list[str], floor: Any, stock_ranks: int = 2
    ) -> None:
        """``stock`` / ``ours``: the two sides' flags (``stock`` on ``stock_ranks`` ranks, ours on
        2); ``floor(flags, load)``: the floor launch."""
        start = time.monotonic()
        save = ["--save", str(root / "stock"), "--save-interval", str(SAVE_AT)]
        self.stock = run_megatron(
            [*stock, *save], nproc=stock_ranks, megatron_fsdp=False, timeout=300
        )
        self.floor = floor(stock, _load(root / "stock", SAVE_AT))
        self.to_fsdp = _convert("torch_dist", root / "stock" / f"iter_{SAVE_AT:07d}", root / "in")
        resave = ["--save", str(root / "fsdp"), "--save-interval", str(BACK_AT - SAVE_AT)]
        self.fsdp = run_megatron([*ours, *_load(root / "in", SAVE_AT), *resave])
        back = root / "fsdp" / f"iter_{BACK_AT:07d}"
        # In process (the command line ran above): one torch import fewer.
        summary = convert("fsdp_dtensor", str(back), str(root / "back"), progress=lambda _: None)
        self.to_stock = "\n".join(summary.lines())
        self.stock_back = run_megatron(
            [*stock, *_load(root / "back", BACK_AT)],
            nproc=stock_ranks,
            megatron_fsdp=False,
            timeout=300,
        )
        self.wall_s = time.monotonic() - start

    @property
    def launches(self) -> str:
        runs = [self.stock, self.floor, self.fsdp, self.stock_back]
        return f"{[round(run.wall_s) for run in runs]} s"


def _resumed_at_dp1(flags: list[str], load: list[str]) -> MegatronRun:
    return run_megatron([*flags, *load], nproc=1, megatron_fsdp=False, timeout=300)


def _resumed_nudged_on_4_ranks(flags: list[str], load: list[str]) -> MegatronRun:
    return floor_run([*flags, *load], nproc=4, megatron_fsdp=False, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Adam: the floor is the stock run resumed at DP = 1 (module docstring)."""
    stock, ours = [*ADAM, *STOCK.split()], [*ADAM, *FSDP.split()]
    return Runs(tmp_path_factory.mktemp("convert"), stock, ours, _resumed_at_dp1)


@pytest.fixture(scope="module")
def muon_runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """megatron-core's Muon (LayerWise, TP = 2 x DP = 2) and ours (TP = 1 x DP = 2): the floor is
    the stock run resumed nudged."""
    stock = [*MUON, *STOCK_MUON.split(), *MUON_TP2]
    ours = [*MUON, *FSDP.split(), *MUON_TP2[-2:]]
    root = tmp_path_factory.mktemp("convert_muon")
    return Runs(root, stock, ours, _resumed_nudged_on_4_ranks, stock_ranks=4)


def assert_continues(label: str, run: MegatronRun, runs: Runs, start: int) -> None:
    """``run``, loaded at iteration ``start``, against the stock run continued at its own layout
    (``runs.stock``, iterations ``start + 1`` on): printed losses and full-precision grad norms
    each within the floor of ``runs.floor`` against it (``tests/run_comparison.py``; the second
    line after a start is the mean of two iterations' losses: ``resumed_expectations``)."""
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
    print(
        f"\nfour launches, two conversions: {runs.wall_s:.0f} s ({runs.launches})\n{runs.to_fsdp}"
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


def test_megatron_cores_layer_wise_muon_run_converted_continues_on_our_muon_within_the_floor(
    muon_runs: Runs,
) -> None:
    """megatron-core's Muon (LayerWise, TP = 2 x DP = 2) saved at iteration 4, converted: ours on
    Megatron-FSDP (TP = 1 x DP = 2) continues it as the stock run continued itself, every
    iteration's loss and grad norm within the floor of the stock run resumed with every weight one
    ulp up. Measured on 2 CPU cores (by hand, the same flags): losses equal to every printed
    digit, grad norms 1.4e-7 apart at most against a floor of 1.5e-7; back on stock, losses 1.7e-7
    (one printed digit) and grad norms 1.1e-7. The four launches took 43 s (20, 8, 5, 3 s; 76 s
    under pytest beside another test run: 28, 16, 9, 7 s). A
    lost momentum (every ``momentum_buffer`` zeroed in the converted checkpoint, measured at DP = 2)
    moves the second iteration's grad norm by 17% (4.234 against 3.619)."""
    runs = muon_runs
    print(
        f"\nfour launches, two conversions: {runs.wall_s:.0f} s ({runs.launches})\n{runs.to_fsdp}"
    )
    # 8 matrices' momentum_buffer; 19 AdamW params' exp_avg, exp_avg_sq, step.
    assert "optimizer states carried: 65" in runs.to_fsdp
    assert runs.stock.optimizers[0]["class"] == "LayerWiseDistributedOptimizer"
    assert runs.fsdp.optimizers[0]["class"] == "MegatronCheckpointedOptimizer"
    assert any(local < rows for local, rows in runs.fsdp.layouts[0].values())
    assert_continues("LayerWise muon torch_dist -> ours fsdp_dtensor", runs.fsdp, runs, SAVE_AT)


def test_our_muon_run_converted_back_continues_on_megatron_cores_layer_wise_muon_within_the_floor(
    muon_runs: Runs,
) -> None:
    print(f"\n{muon_runs.to_stock}")
    assert_continues(
        "ours fsdp_dtensor -> LayerWise muon", muon_runs.stock_back, muon_runs, BACK_AT
    )

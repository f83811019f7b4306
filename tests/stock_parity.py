"""Ours against megatron-core's own optimizer in Megatron-LM's loop, one rank on one device.

The comparison of tests/test_megatron_lm_stock_parity.py: for each optimizer (``CASES``), five
launches of ``tests/megatron_lm_driver.py`` (``tests.torchrun.run_megatron``), one rank each:

- ours: ``install()``, ``--use-megatron-fsdp --ckpt-format fsdp_dtensor`` (optim_grads_params);
- stock: megatron-core's own optimizer under its DDP, no Megatron-FSDP (``install()`` still runs:
  stock ``--optimizer lion`` reads ``--lion-beta1/2`` and stock ``adaptive_muon`` steps only
  after it, ``integrations.stock_lion`` and ``integrations.adaptive_muon_fix``);

each in fp32 params with fp32 Newton-Schulz and in bf16 params with Megatron's default NS
precision; in fp32 a fifth, the floor: stock again with every weight one ulp up
(``tests.run_comparison.floor_run``). Like-for-like flags (what differs otherwise is the
frameworks' choice, not the optimizer's math):

- ``--position-embedding-type rope``: a learned absolute position embedding goes to AdamW in ours
  and to the matrix optimizer in megatron-core;
- fp32: ``--muon-fp32-matmul-prec high`` (Megatron's parser offers no "highest"); on CPU "high"
  is fp32 (oneDNN runs "medium" in bf16 on AVX512-BF16 CPUs), on a GPU it allows TF32, so the
  CUDA runs set ``NVIDIA_TF32_OVERRIDE=0`` (cuBLAS and cuDNN never use TF32): NS, SOAP's
  eigenbases and the model's matmuls in IEEE fp32 on both sides;
- bf16: ``--megatron-fsdp-main-grads-dtype fp32`` in ours: Megatron-FSDP's default ("auto")
  accumulates the micro-batches' gradients in bf16, where megatron-core's DDP accumulates them in
  fp32 under ``--bf16`` (measured on CPU, muon: iteration 1's grad norm 2.677665 with "auto" against
  2.677718 stock; with fp32, 2.6777178 against 2.6777184, reduction order);
- SOAP: one micro-batch (``--micro-batch-size 4``) and ``--clip-grad 0``: SOAP turns last-bit
  gradient differences into visible ones (tests/test_megatron_lm_soap.py says how).

Figures (``Comparison``): the largest relative difference, over the iterations, of the loss (the
loop's log line, 7 significant digits) and of the grad norm (the driver's full-precision record),
of ours against stock in each precision; the fp32 floor (the nudged stock run against stock:
what a last-bit perturbation grows to in megatron-core's own run on this machine) and the bf16
floor: stock bf16 against stock fp32, what bf16 alone changes in megatron-core's own run.

``python -m tests.stock_parity --device cpu [CASE ...]`` runs the same comparison by hand and
prints the table (on 2 CPU cores about 20 s a launch).
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from tests.megatron_lm_logs import max_relative_difference
from tests.run_comparison import floor_run
from tests.torchrun import MegatronRun, run_megatron

DeviceT = Literal["cpu", "cuda"]
PrecisionT = Literal["fp32", "bf16"]
SideT = Literal["ours", "stock", "floor"]

NUM_ITERS = 12
# Each case's optimizer flags. adaptive_muon's adamuon steps sign-like (about 1 per element before
# the scale): an Adam-like lr; normuon and namo normalize by a per-row (column) mean and a norm
# ratio and take Muon's lr (tests/test_megatron_lm_adaptive_muon.py, README's optimizer table).
CASES: dict[str, list[str]] = {
    "muon": "--optimizer muon --lr 0.02".split(),
    **{
        f"adaptive_muon-{method}": [
            *"--optimizer adaptive_muon --adaptive-muon-beta2 0.9 --lr".split(),
            lr,
            *("--adaptive-muon-moment2-method", method),
        ]
        for method, lr in (("adamuon", "0.001"), ("normuon", "0.02"), ("namo", "0.02"))
    },
    "soap": [
        *"--optimizer soap --lr 0.01 --soap-shampoo-beta 0.9".split(),
        *"--micro-batch-size 4 --clip-grad 0".split(),
    ],
    "lion": "--optimizer lion --lr 0.003 --lion-beta1 0.9 --lion-beta2 0.97".split(),
}
COMMON_FLAGS = ["--position-embedding-type", "rope", "--train-iters", str(NUM_ITERS)]
PRECISION_FLAGS: dict[PrecisionT, list[str]] = {
    "fp32": ["--muon-fp32-matmul-prec", "high"],
    "bf16": ["--bf16"],
}
OURS_FLAGS = [
    *("--data-parallel-sharding-strategy", "optim_grads_params"),
    *("--megatron-fsdp-main-grads-dtype", "fp32"),
]
# TINY_GPT_CPU_FLAGS' gloo, replaced (the later flag wins); --use-cpu-initialization stays: both
# sides start from the same CPU-initialized weights, which Megatron-LM's get_model moves to the GPU.
DEVICE_FLAGS: dict[DeviceT, list[str]] = {"cpu": [], "cuda": ["--distributed-backend", "nccl"]}
# Seconds a launch may take; launches run side by side (``launch_all``).
LAUNCH_TIMEOUT_S = 240.0

LaunchKey = tuple[str, PrecisionT, SideT]


def launch(case: str, precision: PrecisionT, side: SideT, device: DeviceT) -> MegatronRun:
    """One rank of Megatron-LM's loop: ``case``'s optimizer, ours, stock or the floor (stock with
    every weight one ulp up; fp32 only), on ``device``."""
    flags = [*CASES[case], *COMMON_FLAGS, *PRECISION_FLAGS[precision], *DEVICE_FLAGS[device]]
    env = {"NVIDIA_TF32_OVERRIDE": "0"} if precision == "fp32" and device == "cuda" else {}
    if side == "ours":
        flags += OURS_FLAGS
    launcher = floor_run if side == "floor" else run_megatron
    return launcher(flags, nproc=1, megatron_fsdp=side == "ours", env=env, timeout=LAUNCH_TIMEOUT_S)


def launch_all(
    keys: list[LaunchKey], device: DeviceT, workers: int
) -> dict[LaunchKey, MegatronRun]:
    """Every ``(case, precision, side)`` launch, ``workers`` at a time (one-rank processes on the
    same device: a tiny GPT leaves the GPU idle, start-up is what takes the time)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {key: pool.submit(launch, *key, device) for key in keys}
        return {key: future.result() for key, future in futures.items()}


def default_workers(device: DeviceT) -> int:
    """Launches side by side: a CPU rank is one thread (OMP_NUM_THREADS=1 in ``run_megatron``),
    so one per core on CPU; on a GPU machine half its cores (imports and start-up are CPU work)."""
    cores = os.cpu_count() or 1
    return max(1, cores if device == "cpu" else cores // 2)


@dataclass(frozen=True)
class Difference:
    """Largest relative differences over the iterations of two runs."""

    loss: float
    grad_norm: float

    @classmethod
    def of(cls, run: MegatronRun, reference: MegatronRun) -> Difference:
        return cls(
            max_relative_difference(run.series("lm loss"), reference.series("lm loss")),
            max_relative_difference(run.grad_norms, reference.grad_norms),
        )


@dataclass(frozen=True)
class Comparison:
    """One case's launches and their differences (module docstring)."""

    case: str
    runs: dict[tuple[PrecisionT, SideT], MegatronRun]

    def difference(self, precision: PrecisionT) -> Difference:
        """Ours against stock in ``precision``."""
        return Difference.of(self.runs[precision, "ours"], self.runs[precision, "stock"])

    @property
    def fp32_floor(self) -> Difference:
        """Stock with every weight one ulp up against stock, fp32: the floor of ours' fp32
        difference (tests/run_comparison.py)."""
        return Difference.of(self.runs["fp32", "floor"], self.runs["fp32", "stock"])

    @property
    def bf16_floor(self) -> Difference:
        """Stock bf16 against stock fp32: what bf16 alone changes in megatron-core's own run."""
        return Difference.of(self.runs["bf16", "stock"], self.runs["fp32", "stock"])

    def rows(self) -> list[str]:
        """Markdown table rows (``TABLE_HEADER``): one per precision compared."""
        rows = []
        for precision in PRECISION_FLAGS:
            if (precision, "ours") not in self.runs:
                continue
            diff = self.difference(precision)
            floor = "-"
            if precision == "bf16" and ("fp32", "stock") in self.runs:
                floor = f"{self.bf16_floor.loss:.2e} / {self.bf16_floor.grad_norm:.2e}"
            elif precision == "fp32":
                floor = f"{self.fp32_floor.loss:.2e} / {self.fp32_floor.grad_norm:.2e}"
            rows.append(
                f"| {self.case} | {precision} | {diff.loss:.2e} | {diff.grad_norm:.2e} | {floor} |"
            )
        return rows


TABLE_HEADER = [
    "| optimizer | precision | loss: max rel. diff. | grad norm: max rel. diff. | "
    "floor (loss / grad norm) |",
    "|---|---|---|---|---|",
]


def compare(
    cases: list[str],
    device: DeviceT,
    precisions: tuple[PrecisionT, ...] = ("fp32", "bf16"),
    workers: int | None = None,
) -> dict[str, Comparison]:
    """Each case's launches in ``precisions``, ours and stock (and the floor in fp32), side by
    side; {case: Comparison}."""
    keys: list[LaunchKey] = [
        (case, precision, side)
        for case in cases
        for precision in precisions
        for side in (("ours", "stock", "floor") if precision == "fp32" else ("ours", "stock"))
    ]
    runs = launch_all(keys, device, workers or default_workers(device))
    return {
        case: Comparison(case, {(p, s): run for (c, p, s), run in runs.items() if c == case})
        for case in cases
    }


def table(comparisons: dict[str, Comparison]) -> str:
    """The figures as a markdown table (docs/gpu.md's stock-parity section)."""
    return "\n".join([*TABLE_HEADER, *(r for c in comparisons.values() for r in c.rows())])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("cases", nargs="*", help=f"of {list(CASES)}; default: all")
    args = parser.parse_args()
    if unknown := [case for case in args.cases if case not in CASES]:
        parser.error(f"unknown cases {unknown}: expected some of {list(CASES)}")
    start = time.monotonic()
    comparisons = compare(args.cases or list(CASES), args.device, workers=args.workers)
    print(table(comparisons))
    print(f"{5 * len(comparisons)} launches in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()

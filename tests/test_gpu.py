"""On a CUDA GPU, with NCCL and no CPU stand-in: what CPU/gloo ranks cannot show.

Every test here carries the ``gpu`` marker and is skipped, with the reason, where no CUDA device is
visible (``tests/conftest.py``): CI is CPU-only. ``scripts/gpu_check.sh OUTDIR`` runs them on a GPU
machine (docs/gpu.md). One NCCL rank on ``cuda:0`` (the harness spawns it: CUDA cannot be used in a
forked process) or one ``torchrun`` process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_muon.testing import run_on_ranks
from tests import gpu_runs
from tests.torchrun import parse_iteration_lines

pytestmark = [pytest.mark.gpu]

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300.0

# Far below bf16's 2^-8 and the medium-vs-highest gap; fp32 NS on both sides ("highest", no TF32):
# the reduction order of the row-sharded and the full-matrix matmuls is the only difference.
HIGHEST_TOLERANCE = 1e-6
# A model of the tests' tiny GPT shape (hidden 64): small enough for each launch to take seconds.
MODEL_FLAGS = [
    *("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128").split(),
    *("--micro-batch-size 4 --global-batch-size 8 --lr 0.01 --lr-decay-style constant").split(),
    *("--hidden-dropout 0.1 --attention-dropout 0.1 --seed 1234 --bf16").split(),
]


def test_syrk_newton_schulz_matches_the_standard_bf16_iteration():
    import torch

    from megatron_muon.newton_schulz.methods import NSConfig, orthogonalize
    from megatron_muon.newton_schulz.syrk import syrk_problem

    if (problem := syrk_problem("cuda")) is not None:
        pytest.skip(f"the syrk NS cannot run here: {problem}")
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # the only precision with a syrk form
    try:
        x = torch.randn(3, 256, 1024, device="cuda")  # batched: one matrix at a time through syrk
        standard = orthogonalize(x, NSConfig())
        syrk = orthogonalize(x, NSConfig(use_syrk=True))
    finally:
        torch.set_float32_matmul_precision(previous)
    # Both iterate in bf16 (2^-8 relative rounding) with different kernels' accumulation orders;
    # five steps of rounding keep the results a few bf16 ulps apart, far from a wrong polynomial.
    relative = (syrk - standard).norm() / standard.norm()
    assert relative < 2e-2, relative


@pytest.mark.multirank
def test_sharded_muon_on_cuda_row_shards_matches_tensor_parallel_muon():
    (result,) = run_on_ranks(gpu_runs.sharded_vs_tensor_parallel_muon, 1, device="cuda")
    print(result)
    assert result["highest"] <= HIGHEST_TOLERANCE, result
    # "medium" runs NS in bf16 on both sides; held to the stock optimizer's own gap between its
    # bf16 and fp32 NS (factor 1): ours may not add more than bf16 NS itself changes.
    assert result["medium"] <= result["medium_vs_highest"], result


@pytest.mark.multirank
def test_momentum_offload_to_pinned_host_memory_is_bitwise():
    (result,) = run_on_ranks(gpu_runs.momentum_offload_is_bitwise, 1, device="cuda")
    assert result["max_abs_diff"] == 0.0, result
    assert result["num_offloaded"] > 0 and result["all_pinned"], result
    assert result["device_bytes_freed"], result


# The bf16 run's update may deviate from the fp32 reference's by at most twice what bf16 autocast
# alone changes in the same reference (measured in the same run; Megatron's bf16 params also keep
# norms and residuals in bf16, which autocast computes in fp32). On CPU ranks the two were 0.062
# and 0.054 of the update; a lost or doubled update is an error of 1.
BF16_FLOOR_FACTOR = 2.0


@pytest.mark.multirank
def test_factory_gpt_with_bf16_compute_weights_tracks_the_fp32_reference():
    (result,) = run_on_ranks(gpu_runs.factory_gpt_bf16, 1, 5, device="cuda", timeout=TIMEOUT_S)
    print(result)
    assert result["compute_dtype"] == "torch.bfloat16", result
    assert result["num_params"] > 10, result
    assert result["error"] <= BF16_FLOOR_FACTOR * result["floor"], result
    assert result["muon_error"] <= BF16_FLOOR_FACTOR * result["muon_floor"], result


def _torchrun(script: list[str], flags: list[str], log: Path) -> list[dict]:
    """One ``torchrun`` process on the GPU; returns the run log's per-iteration train records."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += ["1", *script, *flags, "--log-json", str(log)]
    _run(command)
    return json.loads(log.read_text())["train"]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    """Runs ``command`` from the repository root with it on the path; fails with its output."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def _pretrain(flags: list[str], log: Path) -> list[dict]:
    return _torchrun(["-m", "megatron_muon.pretrain"], ["--optimizer", "muon", *flags], log)


@pytest.mark.multirank
def test_pretrain_entry_point_trains_50_iterations_and_resumes_bitwise(tmp_path):
    """50 iterations with a save at 25 (dropout on: the CUDA RNG state must be restored), then a
    resume from 25: iterations 26-50 equal, loss for loss."""
    run = [*MODEL_FLAGS, "--train-iters", "50", "--log-interval", "1"]
    full = _pretrain(
        [*run, "--save", str(tmp_path / "ckpt"), "--save-interval", "25"], tmp_path / "full.json"
    )
    resumed = _pretrain(
        [*run, "--load", str(tmp_path / "ckpt"), "--ckpt-step", "25"], tmp_path / "resumed.json"
    )
    losses = {r["iteration"]: r["train_loss"] for r in full}
    assert losses[50] < losses[1] - 1.0, losses
    after = {r["iteration"]: r["train_loss"] for r in resumed}
    assert sorted(after) == list(range(26, 51)), sorted(after)
    assert all(after[i] == losses[i] for i in after), [(i, losses[i], after[i]) for i in after]


# The loop test's optimizers. adaptive_muon's adamuon divides by an elementwise second moment: its
# update is sign-like, about 1 per element before the scale, and it wants an Adam-like lr (at
# MODEL_FLAGS' 0.01 megatron-core's own adamuon diverged on an H200: grad norm 2.0 -> 3.3e10 in 30
# iterations); normuon and namo normalize per row (column) or by a norm ratio and take Muon's lr.
LOOP_OPTIMIZERS = {
    "muon": ["--optimizer", "muon"],
    **{
        f"adaptive_muon-{method}": [
            *("--optimizer adaptive_muon --adaptive-muon-moment2-method", method, "--lr", lr),
        ]
        for method, lr in (("adamuon", "0.001"), ("normuon", "0.01"), ("namo", "0.01"))
    },
}


@pytest.mark.multirank
@pytest.mark.parametrize("optimizer", LOOP_OPTIMIZERS)
def test_megatron_lm_loop_with_install_trains_on_megatron_fsdp(tmp_path, optimizer):
    """Megatron-LM's loop (``examples/pretrain_gpt_megatron.py``, the one ``install()`` line) with
    the local transformer (Transformer Engine is not installed here), bf16, NCCL, 20 iterations:
    Muon, and adaptive_muon with each second-moment method (adamuon at lr 0.001, normuon and namo
    at 0.01; ``LOOP_OPTIMIZERS``), each seen in the optimizer's summary. The loss falls by 1.0 (on
    one CPU rank with these flags: adamuon 4.91 -> 3.46, normuon -> 0.13, namo -> 0.02)."""
    flags = [
        *MODEL_FLAGS,
        *LOOP_OPTIMIZERS[optimizer],
        *("--use-megatron-fsdp --ckpt-format fsdp_dtensor").split(),
        *("--data-parallel-sharding-strategy optim_grads_params --transformer-impl local").split(),
        *("--no-gradient-accumulation-fusion --no-masked-softmax-fusion").split(),
        *("--no-persist-layer-norm --no-rope-fusion --max-position-embeddings 128").split(),
        *("--train-iters 20 --log-interval 1 --eval-iters 0 --eval-interval 1000").split(),
        *("--mock-data --tokenizer-type NullTokenizer --vocab-size 128").split(),
    ]
    log = tmp_path / "loop.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += ["1", str(REPO / "tests" / "megatron_lm_driver.py"), *flags]
    done = _run(command)
    log.write_text(done.stdout + done.stderr)
    iterations = parse_iteration_lines(done.stdout)
    assert sorted(iterations) == list(range(1, 21)), done.stdout[-3000:]
    assert iterations[20]["lm loss"] < iterations[1]["lm loss"] - 1.0, iterations
    described = next(
        json.loads(line.split(" ", 1)[1])
        for line in done.stdout.splitlines()
        if line.startswith("MEGATRON_MUON_OPTIMIZER ")
    )
    assert described["class"] == "MegatronCheckpointedOptimizer", described
    assert any("mode owner" in line for line in described["summary"]), described
    if optimizer.startswith("adaptive_muon-"):
        matrix = f"AdaptiveMuon({optimizer.removeprefix('adaptive_muon-')})[dense]"
        assert any(matrix in line for line in described["summary"]), described

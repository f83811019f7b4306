"""A rank killed, a save cut short, SIGTERM: a torchrun job resumes with nothing lost.

Each launch is ``torchrun --max-restarts N tests/restart_fault_driver.py`` on CPU/gloo ranks, the
faults injected by the driver (``MEGATRON_MUON_FAULTS``: attempt, rank, kind, iteration). The
loss and grad norm of every step are compared bitwise (``==`` on the floats the driver prints at
full precision; dropout is off, the data order and the RNG come back from the checkpoint) with an
uninterrupted run of the same flags: the reference launch (``uninterrupted``) for Megatron's loop
at DP=2, and elsewhere, to save launches, the first attempt itself (its steps up to the fault
*are* the uninterrupted run; the restarted attempt repeats them from the last checkpoint).

Without ``megatron_muon.integrations.restart_store`` every restart here stops in process-group
setup (gloo reads the dead attempt's addresses from torchrun's store).

Launches: Megatron's loop at DP=2 (``optim_grads_params``): the reference, the killed-rank run
(2 attempts), the SIGTERM resume; TP=2 x DP=2 (4 ranks, 2 attempts); ``python -m
megatron_muon.pretrain`` (2 attempts); the custom trainer with ``megatron_muon.checkpointing``
(2 attempts). docs/reliability.md has the table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.restart_fault_driver import EXIT_MARKER, FAULT_MARKER, FAULT_VARIABLE, STEP_MARKER
from tests.torchrun import MUON_FLAGS, REPO, TINY_GPT_CPU_FLAGS, MegatronRun, run_megatron

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]

DRIVER = REPO / "tests" / "restart_fault_driver.py"
TRACKER = "latest_checkpointed_iteration.txt"
SAVE_INTERVAL = 3
TRAIN_ITERS = 9
# Megatron's loop at DP=2: the tiny GPT of tests/torchrun.py, Muon on optim_grads_params, a save
# every 3 iterations, SIGTERM handled (save, then exit 0).
MEGATRON_FLAGS = [
    *TINY_GPT_CPU_FLAGS,
    *MUON_FLAGS,
    *("--data-parallel-sharding-strategy optim_grads_params --exit-signal-handler").split(),
    *("--train-iters", str(TRAIN_ITERS), "--save-interval", str(SAVE_INTERVAL)),
]

Steps = dict[int, tuple[float, float]]  # iteration -> (loss, grad norm)


def _launch(
    target: str,
    flags: list[str],
    faults: list[str],
    *,
    restarts: int = 1,
    nproc: int = 2,
    timeout: float = 300,
) -> MegatronRun:
    """torchrun --max-restarts ``restarts`` of the driver's ``target``, the faults injected."""
    return run_megatron(
        [target, *flags],
        nproc=nproc,
        entry=[f"--max-restarts={restarts}", str(DRIVER)],
        entry_prints_done_marker=True,
        env={FAULT_VARIABLE: ",".join(faults)},
        timeout=timeout,
    )


def _records(run: MegatronRun, marker: str, rank: int = 0) -> list[dict[str, Any]]:
    lines = run.rank_outputs[rank].splitlines()
    return [json.loads(line[len(marker) :]) for line in lines if line.startswith(marker)]


def _steps_by_attempt(run: MegatronRun) -> dict[int, Steps]:
    attempts: dict[int, Steps] = {}
    for record in _records(run, STEP_MARKER):
        steps = attempts.setdefault(record["attempt"], {})
        steps[record["iteration"]] = (record["loss"], record["grad_norm"])
    return attempts


def _loaded_iterations(run: MegatronRun) -> list[int]:
    """The iteration of every checkpoint Megatron's loop loaded, in attempt order (rank 0)."""
    return [
        int(line.rsplit("at iteration", 1)[1])
        for line in run.rank_outputs[0].splitlines()
        if "successfully loaded checkpoint from" in line
    ]


def _checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """A ``fsdp_dtensor`` checkpoint's tensors as {dotted key: full tensor} (one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = directory.parent / f"{directory.parent.name}_{directory.name}.pt"
    dcp_to_torch_save(str(directory), str(target))
    flat: dict[str, torch.Tensor] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}.{key}" if prefix else str(key))
        elif torch.is_tensor(value):
            flat[prefix] = value

    walk(torch.load(target, weights_only=False), "")
    return flat


# --------------------------------------------------------------------------------------------------
# Megatron's loop, DP=2: the reference and the killed-rank run (module fixtures, used twice)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("restarts")


@pytest.fixture(scope="module")
def uninterrupted(root: Path) -> tuple[Steps, Path]:
    """The reference: no fault, 9 iterations, saves at 3, 6 and 9."""
    save = root / "uninterrupted"
    run = _launch("megatron", [*MEGATRON_FLAGS, "--save", str(save), "--load", str(save)], [])
    steps = _steps_by_attempt(run)
    assert list(steps) == [0] and sorted(steps[0]) == list(range(1, TRAIN_ITERS + 1))
    return steps[0], save


@pytest.fixture(scope="module")
def killed(root: Path) -> tuple[MegatronRun, Path]:
    """Attempt 0: rank 1 SIGKILLed in the save of iteration 6, after its DCP files and
    ``.metadata`` were written, before Megatron's tracker names it (saved: 3). Attempt 1: SIGTERM
    to both ranks in iteration 7. (A rank killed at a step, in the same loop and layout: the
    pretrain entry point's test.)"""
    save = root / "killed"
    faults = ["0:1:kill_in_save:6", "1:0:sigterm:7", "1:1:sigterm:7"]
    flags = [*MEGATRON_FLAGS, "--save", str(save), "--load", str(save)]
    return _launch("megatron", flags, faults, timeout=400), save


def test_rank_killed_in_a_save_restarts_from_the_previous_checkpoint_and_loses_nothing(
    uninterrupted: tuple[Steps, Path], killed: tuple[MegatronRun, Path]
) -> None:
    reference, reference_save = uninterrupted
    run, save = killed
    attempts = _steps_by_attempt(run)
    # The restart loaded iteration 3: the save of 6 cut short in attempt 0 was never loaded.
    assert _loaded_iterations(run) == [3]
    assert {attempt: sorted(steps) for attempt, steps in attempts.items()} == {
        0: [1, 2, 3, 4, 5, 6],
        1: [4, 5, 6, 7],
    }
    for attempt, steps in attempts.items():
        for iteration, values in steps.items():
            assert values == reference[iteration], (attempt, iteration, values)
    # Attempt 1 saved 6 again over what attempt 0 left there: the same tensors as the reference's.
    expected = _checkpoint_tensors(reference_save / "iter_0000006")
    got = _checkpoint_tensors(save / "iter_0000006")
    assert sorted(got) == sorted(expected)
    differing = [key for key in expected if not torch.equal(got[key], expected[key])]
    assert not differing, differing
    # SIGTERM to every rank in iteration 7: saved at 7, exit 0 on both ranks (torchrun: rc 0).
    assert (save / TRACKER).read_text() == "7"
    for rank in (0, 1):
        assert [exit["code"] for exit in _records(run, EXIT_MARKER, rank)] == [0]
    print(f"\nrank killed in a save, then SIGTERM: 2 attempts, {run.wall_s:.1f} s")


def test_sigterm_to_one_rank_saves_at_that_iteration_and_the_resume_loses_nothing(
    uninterrupted: tuple[Steps, Path], killed: tuple[MegatronRun, Path]
) -> None:
    """Resumes the SIGTERM checkpoint of ``killed`` (iteration 7); rank 1 alone gets SIGTERM in
    iteration 8: Megatron's handler all-gathers the flag, so both ranks save 8 and exit 0."""
    reference, _ = uninterrupted
    _, save = killed
    run = _launch(
        "megatron", [*MEGATRON_FLAGS, "--save", str(save), "--load", str(save)], ["0:1:sigterm:8"]
    )
    assert _loaded_iterations(run) == [7]
    assert _steps_by_attempt(run) == {0: {8: reference[8]}}  # iteration 9 never ran
    assert (save / TRACKER).read_text() == "8"
    (fault,) = _records(run, FAULT_MARKER, rank=1)
    exits = [_records(run, EXIT_MARKER, rank) for rank in (0, 1)]
    assert [[exit["code"] for exit in records] for records in exits] == [[0], [0]]
    seconds = max(records[0]["time"] for records in exits) - fault["time"]
    print(f"\nSIGTERM to rank 1: both ranks saved and exited {seconds:.1f} s after the signal")
    assert seconds < 120, seconds  # one save and the exit; CI's slowest measured: see the docs


# --------------------------------------------------------------------------------------------------
# TP=2 x DP=2, the pretrain entry point, the custom trainer: the first attempt is the reference
# --------------------------------------------------------------------------------------------------


def _assert_restart_repeats_the_first_attempt(run: MegatronRun, repeated: list[int]) -> None:
    attempts = _steps_by_attempt(run)
    assert sorted(attempts) == [0, 1], attempts
    for iteration in repeated:
        assert attempts[1][iteration] == attempts[0][iteration], (iteration, attempts)


def test_tensor_parallel_rank_killed_in_a_save_restarts_from_the_previous_one(root: Path) -> None:
    """TP=2 x DP=2 (4 ranks): rank 3 SIGKILLed in the save of iteration 4 (saved: 2)."""
    save = root / "tp2"
    flags = [
        *MEGATRON_FLAGS,
        *("--tensor-model-parallel-size 2 --train-iters 4 --save-interval 2").split(),
        *("--save", str(save), "--load", str(save)),
    ]
    run = _launch("megatron", flags, ["0:3:kill_in_save:4"], nproc=4, timeout=400)
    assert _loaded_iterations(run) == [2]
    _assert_restart_repeats_the_first_attempt(run, [3, 4])
    assert (save / TRACKER).read_text() == "4"
    print(f"\nTP=2 x DP=2 killed in a save: {run.wall_s:.1f} s")


def test_pretrain_entry_point_rank_killed_at_a_step_restarts_and_loses_nothing(
    root: Path,
) -> None:
    """``python -m megatron_muon.pretrain`` on the embedded text: rank 0 SIGKILLed after the step
    of iteration 3 (saved: 2)."""
    save = root / "pretrain"
    flags = [
        *("--optimizer muon --lr 0.02 --muon-fp32-matmul-prec high").split(),
        *("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32").split(),
        *(
            "--micro-batch-size 2 --global-batch-size 4 --train-iters 4 --lr-decay-style constant"
        ).split(),
        *("--log-interval 1 --eval-iters 0 --eval-interval 1000 --save-interval 2").split(),
        *("--save", str(save), "--load", str(save)),
    ]
    run = _launch("pretrain", flags, ["0:0:kill:3"])
    assert _loaded_iterations(run) == [2]
    _assert_restart_repeats_the_first_attempt(run, [3])
    assert sorted(_steps_by_attempt(run)[1]) == [3, 4]
    print(f"\npretrain entry point killed at a step: {run.wall_s:.1f} s")


def test_custom_trainer_rank_killed_in_a_save_restarts_from_the_previous_one(root: Path) -> None:
    """``examples/custom_trainer.py`` with ``megatron_muon.checkpointing``: rank 1 SIGKILLed in the
    save of step 4 after DCP wrote, before the completion marker (saved: 2)."""
    save = root / "custom"
    flags = ["--steps", "4", "--seq-length", "32", "--save", str(save), "--save-interval", "2"]
    run = _launch("custom", flags, ["0:1:kill_in_save:4"])
    assert "resumed from" in run.rank_outputs[0] and "step_000002 (step 2)" in run.rank_outputs[0]
    _assert_restart_repeats_the_first_attempt(run, [3, 4])
    # The save of 4 was made again, whole; what the cut one left is gone.
    assert sorted(p.name for p in save.iterdir()) == ["step_000002", "step_000004"]
    print(f"\ncustom trainer killed in a save: {run.wall_s:.1f} s")

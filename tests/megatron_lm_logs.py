"""What Megatron-LM's loop printed, and the checks the loop tests make on it: losses that fall,
the largest relative difference of two runs' series, the lines a rank printed with a prefix, a
saved ``fsdp_dtensor`` checkpoint read back as full tensors, and a resumed run against the
uninterrupted one, bitwise. Runs that do not share their arithmetic: tests/run_comparison.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.torchrun import MegatronRun, run_megatron


def assert_loss_falls(losses: list[float], num_iters: int = 5) -> None:
    """The loss over the first ``num_iters`` iterations falls by at least 5%.

    A run whose compute weights never change (stock megatron-core's Muon under no_shard, which
    steps the main weights but never installs them into the compute weights) prints the same loss
    at every iteration and fails here.
    """
    first, last = losses[0], losses[num_iters - 1]
    assert last < 0.95 * first, f"loss did not fall over {num_iters} iterations: {losses}"


def max_relative_difference(values: list[float | None], reference: list[float | None]) -> float:
    """max_i |values_i - reference_i| / |reference_i| over iterations; both complete."""
    if len(values) != len(reference):
        raise AssertionError(f"runs of different lengths:\n{values}\n{reference}")
    pairs = [(v, r) for v, r in zip(values, reference, strict=True) if None not in (v, r)]
    if len(pairs) != len(values):
        raise AssertionError(f"incomplete runs or skipped steps:\n{values}\n{reference}")
    return max(abs(v - r) / abs(r) for v, r in pairs)


def printed_lines(run: MegatronRun, rank: int, prefix: str) -> list[str]:
    """The lines of ``rank``'s output that start with ``prefix`` (what the loop printed)."""
    return [line for line in run.rank_outputs[rank].splitlines() if line.startswith(prefix)]


def load_fsdp_dtensor_checkpoint(directory: Path) -> dict[str, Any]:
    """A ``fsdp_dtensor`` checkpoint as flat {dotted key: full tensor or object} (one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = directory.parent / f"{directory.parent.name}_{directory.name}.pt"
    dcp_to_torch_save(str(directory), str(target))
    nested = torch.load(target, weights_only=False)
    flat: dict[str, Any] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = value

    walk(nested, "")
    return flat


def assert_resumed_bitwise(
    uninterrupted: MegatronRun, resumed: MegatronRun, root: Path, save_at: int, num_iters: int
) -> list[str]:
    """``resumed`` (loaded from ``root/uninterrupted`` at ``save_at``, saving to ``root/resumed``)
    printed the uninterrupted run's grad norms (the driver's full-precision record) and losses of
    iterations ``save_at + 1`` to ``num_iters`` bitwise, and saved at ``num_iters`` every tensor
    bitwise; returns their keys.

    Megatron's first log line after a start averages two iterations' losses (see
    tests/test_megatron_lm_loop.py): the loss of iteration ``save_at + 2`` is not compared.
    """
    assert sorted(resumed.iterations) == list(range(save_at + 1, num_iters + 1))
    assert resumed.grad_norms == uninterrupted.grad_norms[save_at:num_iters]
    for iteration in range(save_at + 1, num_iters + 1):
        expected = uninterrupted.iterations[iteration]
        if iteration != save_at + 2:
            assert resumed.iterations[iteration]["lm loss"] == expected["lm loss"]
    final = f"iter_{num_iters:07d}"
    expected_state = load_fsdp_dtensor_checkpoint(root / "uninterrupted" / final)
    got = load_fsdp_dtensor_checkpoint(root / "resumed" / final)
    tensors = sorted(k for k, v in expected_state.items() if torch.is_tensor(v))
    assert sorted(k for k, v in got.items() if torch.is_tensor(v)) == tensors
    differing = [k for k in tensors if not torch.equal(got[k], expected_state[k])]
    assert not differing, f"resumed run differs from the uninterrupted one in {differing}"
    return tensors


def resave_at_dp(flags: list[str], load: Path, save_at: int, dp: int, out: Path) -> Path:
    """Loads the checkpoint ``load`` saved at iteration ``save_at`` on ``dp`` ranks (Megatron-FSDP,
    ``flags``' model and optimizer) and saves it again, training nothing; returns the new
    ``iter_XXXXXXX`` directory. ``--train-iters save_at`` ends the loop at once, and Megatron's
    exit save writes the loaded state (``save_at`` is no multiple of the save interval 3)."""
    loading = ["--load", str(load), "--ckpt-step", str(save_at), "--no-load-rng"]
    resave = [*("--train-iters", str(save_at), "--override-opt_param-scheduler")]
    resave += ["--save", str(out), "--save-interval", "3"]
    batch = ["--micro-batch-size", "1", "--global-batch-size", str(dp)]
    run_megatron([*flags, *batch, *loading, *resave], nproc=dp, timeout=300)
    return out / f"iter_{save_at:07d}"


def assert_resaved_bitwise(saved: Path, resaved: dict[int, Path]) -> list[str]:
    """Every tensor of each DP size's re-saved checkpoint (``resave_at_dp``) is bitwise the one
    in ``saved``, optimizer state included; returns the state keys."""
    expected = load_fsdp_dtensor_checkpoint(saved)
    tensors = sorted(k for k, v in expected.items() if torch.is_tensor(v))
    state = [k for k in tensors if "optimizer" in k and "state" in k]
    assert state, tensors
    for dp, directory in resaved.items():
        got = load_fsdp_dtensor_checkpoint(directory)
        assert sorted(k for k, v in got.items() if torch.is_tensor(v)) == tensors, dp
        differing = [k for k in tensors if not torch.equal(got[k], expected[k])]
        assert not differing, f"DP={dp}: {differing}"
    return state

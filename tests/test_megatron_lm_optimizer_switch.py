"""Bring a run over in Megatron-LM's own loop: stock AdamW on Megatron-FSDP saves and resumes
with ``install()`` alone, and ``--optimizer-switch-at-load`` continues it with another optimizer.

Every launch runs ``examples/pretrain_gpt_megatron.py`` (its first line is ``install()``) on 2 CPU
ranks (``tests/torchrun.py``; tiny GPT, ``optim_grads_params``: uneven row shards, some empty).
One AdamW run (``adamw_run``, module-scoped) saves at iteration 4 and 6; every other launch
starts from its iteration-4 checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.megatron_lm_driver import DUMP_STATE_VARIABLE
from tests.megatron_lm_logs import (
    assert_resumed_bitwise,
    load_fsdp_dtensor_checkpoint,
    printed_lines,
)
from tests.run_comparison import assert_runs_within_floor, floor_run
from tests.torchrun import MegatronRun, run_megatron

pytestmark = [pytest.mark.timeout(900), pytest.mark.multirank]

SAVE_AT = 4
NUM_ITERS = 6
STRATEGY = ["--data-parallel-sharding-strategy", "optim_grads_params"]
ADAMW_FLAGS = [*("--optimizer adam --lr 0.01 --weight-decay 0.1").split(), *STRATEGY]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("optimizer_switch")


@pytest.fixture(scope="module")
def adamw_run(root: Path) -> MegatronRun:
    """Stock AdamW (megatron-core's ``DistributedOptimizer``), saving at 4 and 6."""
    saving = ["--save", str(root / "uninterrupted"), "--save-interval", str(SAVE_AT)]
    return run_megatron([*ADAMW_FLAGS, "--train-iters", str(NUM_ITERS), *saving], nproc=2)


def _loading(root: Path, name: str, step: int = SAVE_AT) -> list[str]:
    return [
        *("--load", str(root / name), "--ckpt-step", str(step)),
        # The CPU RNG stand-in's CUDA state is a dummy (tests/test_megatron_lm_loop.py says why).
        "--no-load-rng",
    ]


def test_stock_adamw_saves_with_install_alone_and_resumes_bitwise(
    adamw_run: MegatronRun, root: Path
) -> None:
    assert {d["class"] for d in adamw_run.optimizers.values()} == {"DistributedOptimizer"}
    assert (root / "uninterrupted" / f"iter_{SAVE_AT:07d}" / ".metadata").is_file()
    resumed = run_megatron(
        [
            *ADAMW_FLAGS,
            *("--train-iters", str(NUM_ITERS)),
            *_loading(root, "uninterrupted"),
            *("--save", str(root / "resumed"), "--save-interval", str(SAVE_AT)),
        ],
        nproc=2,
    )
    tensors = assert_resumed_bitwise(adamw_run, resumed, root, SAVE_AT, NUM_ITERS)
    moments = [k for k in tensors if k.endswith("exp_avg_sq")]
    assert moments, tensors
    print(
        f"\nAdamW resume: {len(tensors)} tensors bitwise ({len(moments)} second moments); "
        f"wall {adamw_run.wall_s:.1f} s + {resumed.wall_s:.1f} s"
    )


def test_sgd_on_megatron_fsdp_trains_saves_and_resumes_bitwise(tmp_path: Path) -> None:
    # Stock, megatron-core 0.19.2's DistributedOptimizer refuses SGD at build with Megatron-FSDP;
    # install() builds megatron-core's SGD on the row shards (fsdp.optimizer_registry), its
    # momentum buffer created at build on every rank (a lazily created one would hang the save).
    sgd = "--optimizer sgd --sgd-momentum 0.9 --lr 0.05".split()
    flags = [*sgd, *STRATEGY]
    saving = ["--save-interval", "2"]
    uninterrupted = run_megatron(
        [*flags, "--train-iters", "4", "--save", str(tmp_path / "uninterrupted"), *saving],
        nproc=2,
    )
    assert {d["class"] for d in uninterrupted.optimizers.values()} == {
        "MegatronCheckpointedOptimizer"
    }
    losses = uninterrupted.series("lm loss")
    assert losses[-1] < losses[0], losses
    # The same SGD in megatron-core's own DDP (no Megatron-FSDP), another reduction order: losses
    # and grad norms within the floor of that run with every weight one ulp up (floor-judged,
    # tests/run_comparison.py).
    stock_flags = [*sgd, "--train-iters", "4"]
    stock = run_megatron(stock_flags, nproc=2, megatron_fsdp=False)
    floor = floor_run(stock_flags, nproc=2, megatron_fsdp=False)
    assert_runs_within_floor("SGD on Megatron-FSDP vs DDP", uninterrupted, stock, floor)
    resumed = run_megatron(
        [*flags, "--train-iters", "4", *_loading(tmp_path, "uninterrupted", 2)]
        + ["--save", str(tmp_path / "resumed"), *saving],
        nproc=2,
    )
    tensors = assert_resumed_bitwise(uninterrupted, resumed, tmp_path, 2, 4)
    assert [k for k in tensors if k.endswith("momentum_buffer")], tensors
    walls = [run.wall_s for run in (uninterrupted, stock, floor, resumed)]
    print(f"\nSGD: losses {losses}, stock DDP's equal; wall {walls} s")


# --------------------------------------------------------------------------------------------------
# --optimizer-switch-at-load
# --------------------------------------------------------------------------------------------------

SWITCH_STEPS = 3  # iterations after a switched load
TARGET_FLAGS = {
    "muon": "--optimizer muon --lr 0.02",
    "adaptive_muon": "--optimizer adaptive_muon --lr 0.001",  # adamuon: sign-like steps
    "lion": "--optimizer lion --lr 0.001",
    # Muon -> AdamW: the matrices' Adam state starts fresh, whose first steps are sign-like (each
    # element moves by lr): at 0.01 the loss rose after Muon's steps (3.62, 3.86, 3.94).
    "adam": "--optimizer adam --lr 0.001 --weight-decay 0.1",
}
_RUNS: dict[str, tuple[MegatronRun, dict[str, dict[str, torch.Tensor]]]] = {}


def _switched(
    root: Path, target: str, source: str = "uninterrupted", at: int = SAVE_AT
) -> tuple[MegatronRun, Any]:
    """``target`` loading ``root/source``'s checkpoint of iteration ``at`` with the switch,
    training 3 iterations and saving at the last (``root/<target>``); its state right after the
    load, whole (``DUMP_STATE_VARIABLE``: each rank's rows, rank order = row order on the 1-D
    mesh)."""
    key = f"{source}->{target}"
    if key not in _RUNS:
        dump = root / f"dump_{target}_from_{source}"
        run = run_megatron(
            [
                *TARGET_FLAGS[target].split(),
                *STRATEGY,
                "--optimizer-switch-at-load",
                "--override-opt_param-scheduler",  # another lr than the checkpoint's
                *("--train-iters", str(at + SWITCH_STEPS)),
                *_loading(root, source, at),
                *("--save", str(root / target), "--save-interval", str(at + SWITCH_STEPS)),
            ],
            nproc=2,
            env={DUMP_STATE_VARIABLE: str(dump)},
        )
        assert sorted(run.iterations) == list(range(at + 1, at + SWITCH_STEPS + 1))
        ranks = [torch.load(dump / f"rank{r}.pt") for r in range(2)]
        whole = {
            name: {
                k: v if v.ndim == 0 else torch.cat([ranks[0][name][k], ranks[1][name][k]])
                for k, v in ranks[0][name].items()
            }
            for name in ranks[0]
        }
        _RUNS[key] = (run, whole)
    return _RUNS[key]


def _checkpoint_state(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """``{param name: {state key: full tensor}}`` of an ``fsdp_dtensor`` checkpoint."""
    flat = load_fsdp_dtensor_checkpoint(directory)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        if key.startswith("optimizer.state.") and torch.is_tensor(value):
            name, state_key = key[len("optimizer.state.") :].rsplit(".", 1)
            state.setdefault(name, {})[state_key] = value
    return state


def _switch_lines(run: MegatronRun) -> list[str]:
    return printed_lines(run, 0, "megatron-muon optimizer switch:")


def _assert_switched(
    run: MegatronRun,
    after_load: dict[str, dict[str, torch.Tensor]],
    saved: dict[str, dict[str, torch.Tensor]],
    carried: dict[str, str],
    fresh: tuple[str, ...],
) -> tuple[int, int]:
    """AdamW's params (``exp_avg_sq`` in both) hold the checkpoint's state bitwise; every other
    param's ``carried`` keys (new -> old) hold the old tensors bitwise, its ``fresh`` keys zeros;
    the loss falls after the load. Returns (AdamW params, switched params)."""
    adamw = [n for n in after_load if "exp_avg_sq" in after_load[n] and "exp_avg_sq" in saved[n]]
    switched = [n for n in after_load if n not in adamw]
    assert adamw and switched, (sorted(after_load), sorted(saved))
    for name in adamw:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(after_load[name][key], saved[name][key]), (name, key)
    for name in switched:
        for new_key, old_key in carried.items():
            assert torch.equal(after_load[name][new_key], saved[name][old_key]), (name, new_key)
            assert after_load[name][new_key].abs().sum() > 0, (name, new_key)
        for key in fresh:
            assert not after_load[name][key].any(), (name, key)
    losses = run.series("lm loss")
    assert losses[-1] < losses[0], losses
    return len(adamw), len(switched)


@pytest.mark.parametrize(
    ("target", "carried", "fresh"),
    [
        ("muon", {"momentum_buffer": "exp_avg"}, ()),
        ("adaptive_muon", {"momentum_buffer": "exp_avg"}, ("moment2_buffer",)),
        ("lion", {"exp_avg": "exp_avg"}, ()),
    ],
)
def test_adamw_run_continues_on_another_optimizer_with_its_state_carried(
    adamw_run: MegatronRun,
    root: Path,
    target: str,
    carried: dict[str, str],
    fresh: tuple[str, ...],
) -> None:
    run, after_load = _switched(root, target)
    saved = _checkpoint_state(root / "uninterrupted" / f"iter_{SAVE_AT:07d}")
    counts = _assert_switched(run, after_load, saved, carried, fresh)
    lines = _switch_lines(run)
    assert len(lines) == 2, lines  # adam -> adam, adam -> target: once each
    assert any(f"adam -> {target}" in line for line in lines), lines
    print(f"\nadam -> {target}: {counts} (AdamW, switched) params; wall {run.wall_s:.1f} s")
    print("\n".join(lines))


def test_muon_run_continues_on_adamw_with_the_matrices_adam_state_fresh(
    adamw_run: MegatronRun, root: Path
) -> None:
    _switched(root, "muon")  # the Muon run (from AdamW's checkpoint) saved at iteration 7
    at = SAVE_AT + SWITCH_STEPS
    run, after_load = _switched(root, "adam", source="muon", at=at)
    muon_checkpoint = root / "muon" / f"iter_{at:07d}"
    saved = _checkpoint_state(muon_checkpoint)
    # Adam's state is one whole (its step bias-corrects both moments): Muon's momentum has no
    # second moment beside it, so the matrices' Adam state starts fresh, all of it.
    counts = _assert_switched(run, after_load, saved, {}, ("exp_avg", "exp_avg_sq", "step"))
    lines = _switch_lines(run)
    assert any("muon -> adam" in line for line in lines), lines
    print(f"\nmuon -> adam: {counts} (AdamW, switched) params; wall {run.wall_s:.1f} s")
    print("\n".join(lines))

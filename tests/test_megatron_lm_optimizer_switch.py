"""Bring a run over in Megatron-LM's own loop: stock AdamW on Megatron-FSDP saves and resumes
with ``install()`` alone, and ``--optimizer-switch-at-load`` continues it with another optimizer.

Every launch runs ``examples/pretrain_gpt_megatron.py`` (its first line is ``install()``) on 2 CPU
ranks (``tests/torchrun.py``; tiny GPT, ``optim_grads_params``: uneven row shards, some empty).
One AdamW run (``adamw_run``, module-scoped) saves at iteration 4 and 6; every other launch
starts from its iteration-4 checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.megatron_lm_logs import assert_resumed_bitwise
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


def _loading(root: Path, name: str) -> list[str]:
    return [
        *("--load", str(root / name), "--ckpt-step", str(SAVE_AT)),
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

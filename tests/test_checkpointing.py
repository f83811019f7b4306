"""Distributed checkpoints under Megatron-FSDP: exact resume, resharding, atomicity, clear errors.

The model (``tests.checkpoint_toys``) is ``ToyMLP`` wrapped by ``megatron_fsdp.fully_shard_model``
(uneven row shards, empty at 3 ranks under ``optim``); its matrices train with ``ShardedMuon`` and
its biases with torch ``AdamW``, with a small warm-up scheduler over both. Each ``run_on_ranks``
launch is a fresh set of processes, so a load never sees state left by the save.

- Resume (same DP size, every sharding strategy, bf16 compute weights): train k steps, save, train
  n more; fresh ranks load and train n more: params and optimizer state are **bitwise** equal to the
  uninterrupted run (with a rank-specific random draw each step, so RNG restore is checked too);
  DCP's metadata holds exactly each rank's true rows, none for an empty shard.
- Reshard (saved at DP=2, loaded at DP=1 and DP=3 under other strategies; HSDP onto plain FSDP;
  3-D experts; plain uneven DTensors): params, Muon momentum and AdamW moments gathered to full
  tensors are bitwise the saved ones; the next step equals the never-resharded DP=2 run within 1e-6
  relative (the grads' all-reduce order differs with DP size).
- Errors and atomicity: every rank raises the same error naming what is wrong, and nothing is
  changed; an interrupted save never loads; an existing checkpoint is replaced only on request.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.checkpoint_toys import (
    DIM,
    assert_bitwise_equal,
    assert_loads_fail,
    assert_resharded,
    build,
    full_snapshot,
    load_train,
    train,
    train_save_train,
)
from tests.muon_reference import MUON_KWARGS

pytestmark = pytest.mark.multirank  # every test here launches ranks


# --------------------------------------------------------------------------------------------------
# exact resume at the same DP size
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy,world_size",
    [
        ("no_shard", 2),
        ("optim", 2),
        ("optim_grads", 2),
        ("optim_grads_params", 2),
        ("optim", 3),
        ("optim_grads_params_bf16", 2),
    ],
)
def test_resume_in_fresh_processes_is_bitwise_equal_to_the_uninterrupted_run(
    strategy, world_size, tmp_path
):
    path = str(tmp_path / "ckpt")
    k, n = 2, 2
    uninterrupted = run_on_ranks(train_save_train, world_size, strategy, path, k, n)
    resumed = run_on_ranks(load_train, world_size, strategy, path, n)
    for rank in range(world_size):
        assert resumed[rank]["iteration"] == k
        assert resumed[rank]["extra"] == {"tokens": 7}
        assert resumed[rank]["rng_restored"]
        assert_bitwise_equal(
            uninterrupted[rank]["snapshot"], resumed[rank]["snapshot"], f"rank {rank}"
        )
    if not strategy.startswith("no_shard"):
        # DCP's metadata: each rank wrote exactly its true (uneven; at DP=3 also empty) rows.
        layouts = uninterrupted[0]["layouts"]
        has_empty = any(stop == start for ranges in layouts.values() for start, stop in ranges)
        assert has_empty or world_size == 2, layouts
        _assert_each_rank_wrote_exactly_its_rows(path, layouts, world_size)


def _assert_each_rank_wrote_exactly_its_rows(path: str, layouts: dict, world_size: int) -> None:
    """DCP metadata: per param, one chunk per non-empty row range (true uneven offsets), none for
    an empty shard, stored in the file of a rank that holds those rows."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(path).read_metadata()
    for name, ranges in layouts.items():
        holders: dict[tuple[int, int], set[int]] = {}
        for rank, (start, stop) in enumerate(ranges):
            if stop > start:
                holders.setdefault((start, stop), set()).add(rank)
        for fqn in [f"model.{name}"] + [
            key
            for key in metadata.state_dict_metadata
            if key.startswith(f"optimizer.state.{name}.")
        ]:
            tensor_metadata = metadata.state_dict_metadata[fqn]
            if len(tensor_metadata.size) == 0:  # Adam's step: a replicated scalar
                continue
            chunks = {(c.offsets[0], c.offsets[0] + c.sizes[0]) for c in tensor_metadata.chunks}
            assert chunks == set(holders), (fqn, chunks, holders)
            for index, info in metadata.storage_data.items():
                if index.fqn == fqn:
                    start = index.offset[0]
                    writer = int(info.relative_path.removeprefix("__").split("_")[0])
                    rows = next(r for r in holders if r[0] == start)
                    assert writer in holders[rows], (fqn, start, info.relative_path, holders)
    files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    assert files == [f"__{r}_0.distcp" for r in range(world_size)], files


# --------------------------------------------------------------------------------------------------
# resharding: saved at DP=2, loaded at DP=1 and DP=3 under other strategies
# --------------------------------------------------------------------------------------------------


def _save_and_snapshot(rank, world_size, strategy, path, k, moe=False) -> dict:
    """Trains k steps and saves; returns the full state at the save and after one more step."""
    from megatron_muon.checkpointing import save_checkpoint

    wrapped, optimizers, scheduler = build(world_size, strategy, moe=moe)
    train(wrapped, optimizers, scheduler, rank, world_size, k, 0, noise=False)
    save_checkpoint(path, wrapped, optimizers, scheduler, iteration=k)
    saved = full_snapshot(wrapped, optimizers)
    train(wrapped, optimizers, scheduler, rank, world_size, 1, k, noise=False)
    return {"saved": saved, "next": full_snapshot(wrapped, optimizers)}


def _load_and_snapshot(rank, world_size, strategy, path, moe=False) -> dict:
    from megatron_muon.checkpointing import load_checkpoint

    wrapped, optimizers, scheduler = build(world_size, strategy, seed=123, moe=moe)
    loaded = load_checkpoint(path, wrapped, optimizers, scheduler)
    after_load = full_snapshot(wrapped, optimizers)
    train(wrapped, optimizers, scheduler, rank, world_size, 1, loaded.iteration, noise=False)
    return {
        "loaded": after_load,
        "next": full_snapshot(wrapped, optimizers),
        "rng_restored": loaded.rng_restored,
    }


@pytest.fixture(scope="module")
def dp2_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("reshard") / "ckpt")
    results = run_on_ranks(_save_and_snapshot, 2, "optim", path, 3)
    return path, results[0]


def test_dp2_checkpoint_chunks_are_the_true_row_layouts(dp2_checkpoint):
    path, reference = dp2_checkpoint
    _assert_each_rank_wrote_exactly_its_rows(path, reference["saved"]["layouts"], 2)


@pytest.mark.parametrize("world_size,strategy", [(1, "no_shard"), (3, "optim_grads_params")])
def test_dp2_checkpoint_reshards_onto_another_dp_size_and_strategy(
    dp2_checkpoint, world_size, strategy
):
    path, reference = dp2_checkpoint
    assert_resharded(reference, run_on_ranks(_load_and_snapshot, world_size, strategy, path))


@pytest.mark.parametrize("outer", ["optim"])
def test_hsdp_checkpoint_loads_onto_plain_fsdp_with_every_row_in_place(outer, tmp_path):
    """Saved under HSDP (4 ranks; outer optim: (Shard(0), Shard(0)), rank order unlike row order),
    loaded at DP=3 optim: params and all optimizer state bitwise the saved ones."""
    path = str(tmp_path / "hsdp")
    reference = run_on_ranks(_save_and_snapshot, 4, f"hsdp_{outer}", path, 2)[0]
    for result in run_on_ranks(_load_and_snapshot, 3, "optim", path):
        for name, tensor in reference["saved"]["params"].items():
            assert torch.equal(result["loaded"]["params"][name], tensor), name
        for name, state in reference["saved"]["state"].items():
            for key, tensor in state.items():
                assert torch.equal(result["loaded"]["state"][name][key], tensor), f"{name}.{key}"


def test_expert_momentum_survives_save_and_load_at_another_dp_size(tmp_path):
    """3-D expert weights (5 experts: uneven whole-expert shards) under a ShardedMuon over an
    expert data-parallel group: saved at DP=2, loaded at DP=3, momentum on the right experts."""
    path = str(tmp_path / "moe")
    reference = run_on_ranks(_save_and_snapshot, 2, "optim", path, 2, moe=True)[0]
    momentum = reference["saved"]["state"]["experts_fc1"]["momentum_buffer"]
    assert momentum.shape == (5, 24, DIM) and momentum.abs().sum() > 0
    layouts = reference["saved"]["layouts"]
    assert layouts["experts_fc1"] != ((0, 5), (0, 5)), "experts should be sharded"
    results = run_on_ranks(_load_and_snapshot, 3, "optim_grads", path, moe=True)
    assert_resharded(reference, results)


# Plain DTensors in a plain module: no megatron_fsdp_slice, chunks from megatron_fsdp's gather.
CONSTRUCTED_SHAPES = [(16, 8), (7, 12)]
CONSTRUCTED_SPLITS = {2: [[5, 11], [0, 7]], 3: [[3, 3, 10], [7, 0, 0]]}


def _constructed(rank, world_size, path, save) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from megatron_muon import ShardedMuon
    from megatron_muon.checkpointing import load_checkpoint, save_checkpoint

    mesh = init_device_mesh("cpu", (world_size,))
    module = torch.nn.Module()
    for index, (shape, rows) in enumerate(
        zip(CONSTRUCTED_SHAPES, CONSTRUCTED_SPLITS[world_size], strict=True)
    ):
        full = torch.randn(*shape, generator=torch.Generator().manual_seed(index + 10 * save))
        start = sum(rows[:rank])
        local = full[start : start + rows[rank]].clone()
        dtensor = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
        module.register_parameter(f"w{index}", torch.nn.Parameter(dtensor))
    optimizer = ShardedMuon.from_keywords(list(module.parameters()), **MUON_KWARGS)
    if save:
        for index, param in enumerate(module.parameters()):
            grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(100 + index))
            rows = CONSTRUCTED_SPLITS[world_size][index]
            start = sum(rows[:rank])
            param.grad = DTensor.from_local(
                grad[start : start + rows[rank]].clone(),
                mesh,
                [Shard(0)],
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        optimizer.step()
        save_checkpoint(path, module, optimizer, iteration=1)
    else:
        load_checkpoint(path, module, optimizer)
    return full_snapshot(module, [optimizer])


def test_plain_uneven_dtensors_without_fsdp_slices_reshard_through_gathered_chunks(tmp_path):
    path = str(tmp_path / "plain")
    saved = run_on_ranks(_constructed, 2, path, True)[0]
    for loaded in run_on_ranks(_constructed, 3, path, False):
        for name, tensor in saved["params"].items():
            assert torch.equal(loaded["params"][name], tensor), name
            momentum = saved["state"][name]["momentum_buffer"]
            assert momentum.abs().sum() > 0
            assert torch.equal(loaded["state"][name]["momentum_buffer"], momentum), name


# --------------------------------------------------------------------------------------------------
# errors: every rank raises the same error, naming what is wrong; nothing is changed
# --------------------------------------------------------------------------------------------------


def test_missing_or_incomplete_checkpoints_are_refused_naming_what_is_wrong(
    dp2_checkpoint, tmp_path
):
    import shutil

    from megatron_muon.checkpointing import MARKER_NAME

    copies = {}
    for case in ("no_marker", "no_rank_file", "truncated"):
        copies[case] = str(tmp_path / case)
        shutil.copytree(dp2_checkpoint[0], copies[case])
    os.remove(os.path.join(copies["no_marker"], MARKER_NAME))
    os.remove(os.path.join(copies["no_rank_file"], "__1_0.distcp"))
    truncated = os.path.join(copies["truncated"], "__0_0.distcp")
    os.truncate(truncated, os.path.getsize(truncated) // 2)
    missing = str(tmp_path / "never_saved")
    assert_loads_fail(
        [
            (missing, "CheckpointNotFoundError", (missing, "does not exist")),
            (copies["no_marker"], "IncompleteCheckpointError", ("no completion marker",)),
            (
                copies["no_rank_file"],
                "IncompleteCheckpointError",
                ("__1_0.distcp (rank 1's shards) is missing",),
            ),
            (copies["truncated"], "IncompleteCheckpointError", ("__0_0.distcp has",)),
        ]
    )


def test_a_different_model_shape_is_named(dp2_checkpoint):
    phrases = (
        "param fc1.weight: shape (48, 16) in the checkpoint, (40, 16) in this model",
        "param fc2.weight: shape (16, 48) in the checkpoint, (16, 40) in this model",
    )
    assert_loads_fail([(dp2_checkpoint[0], "CheckpointMismatchError", phrases)], hidden=40)


def test_adam_state_into_muon_is_named(tmp_path):
    path = str(tmp_path / "adam_only")
    phrase = (
        "param fc1.weight: the checkpoint holds AdamW state ['step', 'exp_avg', 'exp_avg_sq'], "
        "this run's optimizer for it is ShardedMuon with state ['momentum_buffer']"
    )
    assert_loads_fail([(path, "CheckpointMismatchError", (phrase,))], save_all_adam_to=path)


def _interrupted_save(rank, world_size, path) -> dict:
    """A save whose publish step fails on rank 0 (as if killed after the DCP writes)."""
    from megatron_muon import checkpointing
    from megatron_muon.checkpointing import files as checkpoint_files

    wrapped, optimizers, scheduler = build(world_size, "optim")
    train(wrapped, optimizers, scheduler, rank, world_size, 1, 0, noise=False)

    def crash(*args, **kwargs):
        raise OSError("simulated crash before the completion marker")

    checkpoint_files.publish = crash
    try:
        checkpointing.save_checkpoint(path, wrapped, optimizers, scheduler, iteration=1)
    except OSError as error:
        return {"save_error": str(error)}
    return {"save_error": None}


def test_an_interrupted_save_never_loads_as_valid(tmp_path):
    from megatron_muon.checkpointing import INCOMPLETE_SUFFIX

    path = str(tmp_path / "ckpt")
    results = run_on_ranks(_interrupted_save, 2, path)
    assert all("simulated crash" in r["save_error"] for r in results), results
    assert not os.path.exists(path) and os.path.isdir(path + INCOMPLETE_SUFFIX)
    assert_loads_fail(
        [
            (path, "CheckpointNotFoundError", ("a save that did not finish",)),
            (path + INCOMPLETE_SUFFIX, "IncompleteCheckpointError", ("no completion marker",)),
        ]
    )


def _save_twice(rank, world_size, path) -> dict:
    from megatron_muon.checkpointing import load_checkpoint, save_checkpoint

    wrapped, optimizers, scheduler = build(world_size, "optim")
    save_checkpoint(path, wrapped, optimizers, scheduler, iteration=1)
    try:
        save_checkpoint(path, wrapped, optimizers, scheduler, iteration=2)
        refused = ""
    except FileExistsError as error:
        refused = str(error)
    save_checkpoint(path, wrapped, optimizers, scheduler, iteration=3, overwrite=True)
    return {"refused": refused, "iteration": load_checkpoint(path, wrapped, optimizers).iteration}


def test_an_existing_checkpoint_is_replaced_only_with_overwrite(tmp_path):
    from megatron_muon.checkpointing import INCOMPLETE_SUFFIX

    path = str(tmp_path / "ckpt")
    for result in run_on_ranks(_save_twice, 2, path):
        assert "exists (pass overwrite=True to replace)" in result["refused"], result
        assert result["iteration"] == 3
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], os.listdir(tmp_path)
    assert not os.path.exists(path + INCOMPLETE_SUFFIX)

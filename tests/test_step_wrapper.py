"""The FSDP step wrapper and the chained optimizer around it, on a real Megatron-FSDP GPTModel.

Numerical parity of whole training runs is in ``test_factory.py``; here: what Megatron's loop and
checkpointing rely on (rank-symmetric state from construction on, no dummy step, param groups the
scheduler reads, delegation), the global grad norm against stock megatron-core's local-shard norm,
and recognising Megatron-FSDP modules by class.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.gpt_parity import Run

pytestmark = pytest.mark.multirank  # every test here launches ranks


def _state_signature(optimizer) -> list[tuple[str, tuple[str, ...], tuple[int, ...]]]:
    """(optimizer class, state keys, local shape of the first state tensor) per param, in order."""
    from megatron_muon.engine.layout import local_tensor

    signature = []
    for sub in optimizer.chained_optimizers:
        for param in sub.get_parameters():
            state = sub.optimizer.state.get(param, {})
            tensors = [v for v in state.values() if torch.is_tensor(v) and v.ndim > 0]
            shape = tuple(local_tensor(tensors[0]).shape) if tensors else ()
            signature.append((type(sub.optimizer).__name__, tuple(sorted(state)), shape))
    return signature


def _wrapper_contract(rank: int, world_size: int) -> dict:
    import megatron_fsdp
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_muon import build_muon_optimizer
    from megatron_muon.common.megatron_fsdp_compat import (
        megatron_fsdp_classes,
        unwrap_megatron_fsdp,
    )
    from megatron_muon.engine.layout import local_tensor

    gpt_parity.init_megatron()
    run = Run("mcore", "optim_grads_params")
    wrapped = gpt_parity.wrap(gpt_parity.build_gpt(), run, world_size)
    before = {n: local_tensor(p.detach()).clone() for n, p in wrapped.named_parameters()}
    optimizer = build_muon_optimizer(gpt_parity.optimizer_config(), [wrapped])
    out: dict = {}

    # Construction creates every param's state on every rank and changes no weight.
    out["state_at_build"] = _state_signature(optimizer)
    out["unchanged_at_build"] = all(
        torch.equal(local_tensor(p.detach()), before[n]) for n, p in wrapped.named_parameters()
    )
    out["empty_shards"] = sum(local_tensor(p).numel() == 0 for _, p in wrapped.named_parameters())

    # What Megatron's loop reads.
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=gpt_parity.LR,
        min_lr=gpt_parity.LR / 10,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=gpt_parity.WEIGHT_DECAY,
        end_wd=gpt_parity.WEIGHT_DECAY,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    scheduler.step(1)
    out["groups"] = [
        (g["lr"], g["weight_decay"], g["wd_mult"], g["default_config"], len(g["params"]))
        for g in optimizer.param_groups
    ]
    out["loss_scale"] = float(optimizer.get_loss_scale())
    out["is_stub"] = optimizer.is_stub_optimizer
    out["num_chained"] = len(optimizer.chained_optimizers)

    # One step: the global norm, and what stock ChainedOptimizer computes from local shards.
    tokens, labels = gpt_parity.batch(0, world_size)
    mine = tokens.view(world_size, -1, gpt_parity.SEQ)[rank]
    mine_labels = labels.view(world_size, -1, gpt_parity.SEQ)[rank]
    optimizer.zero_grad()
    gpt_parity.loss_of(wrapped, mine, mine_labels).backward()
    for module in optimizer.fsdp_modules:
        module.finish_grad_sync()
    out["global_norm"] = optimizer.get_grad_norm()
    _, out["reference_norm"], _ = gpt_parity.Reference(gpt_parity.build_gpt()).step(tokens, labels)
    optimizer.grads_already_synced = True
    ok, grad_norm, _ = optimizer.step()
    out["step"] = (ok, float(grad_norm))
    for _ in range(2):
        optimizer.zero_grad()
        gpt_parity.loss_of(wrapped, mine, mine_labels).backward()
        optimizer.grads_already_synced = False
        optimizer.step()
        scheduler.step(1)
    out["state_after_steps"] = _state_signature(optimizer)
    adamw = optimizer.chained_optimizers[1].optimizer
    out["adamw_steps"] = sorted({float(s["step"]) for s in adamw.state.values()})
    optimizer.zero_grad()
    out["grads_after_zero_grad"] = sum(p.grad is not None for p in optimizer.get_parameters())
    out["state_dict_keys"] = [sorted(sd["state"]) for sd in optimizer.state_dict()]

    # Megatron-FSDP recognised by class: megatron-core's wrapper and both MegatronFSDP copies.
    out["classes"] = [f"{c.__module__}.{c.__name__}" for c in megatron_fsdp_classes()]
    own = gpt_parity.wrap(gpt_parity.build_gpt(), Run("fully_shard", "optim"), world_size)
    out["recognised"] = [
        type(unwrap_megatron_fsdp(wrapped)).__module__,
        type(unwrap_megatron_fsdp(own)).__module__,
        unwrap_megatron_fsdp(wrapped.module.module),  # the bare GPTModel: None
        unwrap_megatron_fsdp(torch.nn.Linear(2, 2)),
    ]
    assert isinstance(own, megatron_fsdp.MegatronFSDP)
    return out


@pytest.fixture(scope="module")
def contract() -> list[dict]:
    return run_on_ranks(_wrapper_contract, 2, timeout=300)


def test_state_exists_for_every_param_on_every_rank_from_construction_on(contract):
    assert contract[0]["empty_shards"] + contract[1]["empty_shards"] > 0  # 0-row shards present
    for result in contract:
        assert all(keys for _, keys, _ in result["state_at_build"])
        assert {name for name, _, _ in result["state_at_build"]} == {"ShardedMuon", "AdamW"}
    # Same optimizer and state keys for every param on both ranks (local shapes differ).
    keys = [[entry[:2] for entry in result["state_at_build"]] for result in contract]
    assert keys[0] == keys[1]


def test_construction_does_not_step_the_weights(contract):
    # A zero-grad "dummy" step to create state would apply decoupled weight decay.
    assert all(result["unchanged_at_build"] for result in contract)


def test_adamw_step_count_advances_on_ranks_that_hold_no_rows(contract):
    for result in contract:
        assert result["adamw_steps"] == [3.0]
        assert [e[:2] for e in result["state_after_steps"]] == [
            e[:2] for e in result["state_at_build"]
        ]
    assert contract[0]["state_dict_keys"] == contract[1]["state_dict_keys"]


def test_param_groups_follow_the_scheduler_and_skip_decay_on_biases_and_norms(contract):
    for result in contract:
        groups = result["groups"]
        assert groups == contract[0]["groups"]
        lr = gpt_parity.LR / 2  # warmup step 1 of 2
        for group_lr, weight_decay, wd_mult, _, _ in groups:
            assert group_lr == pytest.approx(lr)
            assert weight_decay == pytest.approx(gpt_parity.WEIGHT_DECAY * wd_mult)
        assert sorted({g[2] for g in groups if g[4]}) == [0.0, 1.0]
        assert result["loss_scale"] == 1.0
        assert result["is_stub"] is False
        assert result["num_chained"] == 2
        assert result["grads_after_zero_grad"] == 0


def test_grad_norm_is_the_full_gradient_norm_on_every_rank(contract):
    # Stock ChainedOptimizer (megatron-core 0.19.2) sums local FSDP shards over the
    # model-parallel group only: a different, too small norm on each rank.
    for result in contract:
        assert result["global_norm"] == pytest.approx(result["reference_norm"], rel=1e-5)
        assert result["step"] == (True, pytest.approx(result["global_norm"], rel=1e-12))
    assert contract[0]["global_norm"] == contract[1]["global_norm"]


def test_megatron_fsdp_modules_are_recognised_by_class_not_by_attributes(contract):
    result = contract[0]
    assert result["classes"] == [
        "megatron_fsdp.megatron_fsdp.MegatronFSDP",
        "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp.MegatronFSDP",
    ]
    assert result["recognised"] == [
        "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
        "megatron_fsdp.megatron_fsdp",
        None,
        None,
    ]


def _bf16_steps(rank: int, world_size: int) -> dict:
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel

    from megatron_muon import build_muon_optimizer
    from megatron_muon.engine.layout import local_tensor

    gpt_parity.init_megatron()
    model = gpt_parity.build_gpt()
    model.config.bf16 = True
    model = model.to(torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params",
        use_megatron_fsdp=True,
        gradient_reduce_div_fusion=False,
        overlap_grad_reduce=True,
    )
    wrapped = FullyShardedDataParallel(model.config, ddp_config, model, device=torch.device("cpu"))
    optimizer = build_muon_optimizer(gpt_parity.optimizer_config(bf16=True), [wrapped])
    params = optimizer.get_parameters()
    before = [local_tensor(p.detach()).clone() for p in params]
    tokens, labels = gpt_parity.batch(0, world_size)
    mine = tokens.view(world_size, -1, gpt_parity.SEQ)[rank]
    mine_labels = labels.view(world_size, -1, gpt_parity.SEQ)[rank]
    losses, norms = [], []
    for _ in range(3):
        optimizer.zero_grad()
        loss = gpt_parity.loss_of(wrapped, mine, mine_labels)
        loss.backward()
        ok, grad_norm, _ = optimizer.step()
        assert ok
        losses.append(float(loss.detach()))
        norms.append(float(grad_norm))
    changed = [
        not torch.equal(local_tensor(p.detach()), old)
        for p, old in zip(params, before, strict=True)
    ]
    return {
        "dtypes": sorted({str(p.dtype) for p in params}),
        "losses": losses,
        "norms": norms,
        "changed": sum(changed),
        "nonempty": sum(local_tensor(p).numel() > 0 for p in params),
    }


def test_bf16_model_trains_with_fp32_main_params_and_no_float16_optimizer_wrapper():
    # megatron-core's Float16OptimizerWithFloat16Params needs main_grad, which Megatron-FSDP's
    # DTensor main params lack (0.19.2 crashes there): the factory keeps FP32Optimizer.
    for result in run_on_ranks(_bf16_steps, 2, timeout=300):
        assert result["dtypes"] == ["torch.float32"]
        assert all(torch.isfinite(torch.tensor(result["losses"] + result["norms"])))
        assert result["losses"][-1] < result["losses"][0]
        assert result["changed"] == result["nonempty"]


def _nan_gradient_on_rank_1(rank: int, world_size: int) -> dict:
    from megatron_muon import build_muon_optimizer
    from megatron_muon.checkpointing import leaf_optimizers
    from tests.checkpoint_toys import assert_bitwise_equal, local_snapshot

    gpt_parity.init_megatron()
    run = Run("mcore", "optim_grads_params")
    wrapped = gpt_parity.wrap(gpt_parity.build_gpt(), run, world_size)
    optimizer = build_muon_optimizer(gpt_parity.optimizer_config(), [wrapped])
    results = []
    snapshots = []
    for step in range(3):
        tokens, labels = gpt_parity.batch(step, world_size)
        mine = [t.view(world_size, -1, gpt_parity.SEQ)[rank] for t in (tokens, labels)]
        optimizer.zero_grad()
        loss = gpt_parity.loss_of(wrapped, *mine)
        if step == 1 and rank == 1:
            loss = loss * float("nan")  # NaN gradients on rank 1 only
        loss.backward()
        snapshots.append(local_snapshot(wrapped, leaf_optimizers(optimizer)))
        ok, grad_norm, _ = optimizer.step()
        results.append((ok, grad_norm))
    snapshots.append(local_snapshot(wrapped, leaf_optimizers(optimizer)))
    unchanged = True
    try:
        assert_bitwise_equal(snapshots[1], snapshots[2], "the skipped step")
    except AssertionError:
        unchanged = False
    finite = all(
        bool(torch.isfinite(tensor).all())
        for tensor in [*snapshots[3]["params"].values()]
        + [t for state in snapshots[3]["state"].values() for t in state.values()]
    )
    return {"results": results, "unchanged": unchanged, "finite_after": finite}


def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank_and_changes_nothing():
    # Before: the step ran, and Muon's Newton-Schulz spread the NaN to whole matrices on every
    # rank (the main weights every rank's forward reads).
    for rank, result in enumerate(run_on_ranks(_nan_gradient_on_rank_1, 2, timeout=120)):
        (ok_0, norm_0), (ok_1, norm_1), (ok_2, norm_2) = result["results"]
        assert ok_0 and ok_2 and math.isfinite(norm_0) and math.isfinite(norm_2), result
        assert not ok_1 and math.isnan(norm_1), (rank, result["results"])
        assert result["unchanged"], f"rank {rank}: weights or state changed by the skipped step"
        assert result["finite_after"], f"rank {rank}: NaN in weights or state"

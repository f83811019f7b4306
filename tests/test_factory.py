"""build_muon_optimizer on real Megatron-FSDP GPTModels: parity with an unsharded reference.

Each launch trains the tiny GPTModel (local spec, 2 layers, hidden 64, 4 heads, vocab 256, seq 32)
for 5 steps of real forward/backward on 2 gloo ranks, under every sharding strategy in turn, next
to a single-process fp32 reference (TensorParallelMuon + AdamW on full tensors, same routing,
same data; ``tests/gpt_parity.py``). Clipping is active at every step (clip_grad 0.3 < grad norm),
so the global grad norm over FSDP shards is checked too. Params are compared by whole-param
relative error (Frobenius), ``fp32_matmul_prec="highest"``, within twice the largest deviation that
fp32 reduction order alone causes between two runs of the reference (``gpt_parity.FLOOR_FACTOR``);
losses and grad norms **floor-judged** against the same two runs' (``tests/run_comparison.py``'s
``assert_steps_within_floor``: within ``FLOOR_FACTOR`` times the reordered reference's difference
from the reference up to each step, plus 4 fp32 ulps). The toy without parallel state (one MSE
step, fp32 "highest", 2-rank reduction order) is a single-step reference comparison:
``TOLERANCE``, as the one-step rule of docs/exactness.md.
"""

from __future__ import annotations

import re
from typing import get_args

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.factory_gpt_runs import assert_matches_reference, by_run, train_runs
from tests.fsdp_models import STRATEGIES
from tests.gpt_parity import Run
from tests.run_comparison import assert_steps_within_floor

# Params: within gpt_parity.FLOOR_FACTOR of the reduction-order floor measured in the same launch
# (the MoE router's own floor is the largest: Newton-Schulz amplifies its small singular values).
# The toy without parallel state: fp32 "highest", 2-rank reduction order of one MSE step.
TOLERANCE = 1e-5
# One loop flavour per strategy, so that every flavour meets a sharded and an unsharded strategy:
# Megatron-LM's (the loop calls finish_grad_sync; grads_already_synced=True) and gradient
# accumulation over 2 micro-batches.
MCORE_RUNS = [
    Run("mcore", "no_shard"),
    Run("mcore", "optim", num_microbatches=2, megatron_loop=True),
    Run("mcore", "optim_grads", num_microbatches=2),
    Run("mcore", "optim_grads_params", megatron_loop=True),
]
FULLY_SHARD_RUNS = [
    Run("fully_shard", "no_shard", megatron_loop=True, mode="gather"),
    Run("fully_shard", "optim", num_microbatches=2),
    Run("fully_shard", "optim_grads", mode="gather"),
    Run("fully_shard", "optim_grads_params", num_microbatches=2),
]


@pytest.fixture(scope="module")
def mcore_results() -> dict[Run, list[dict]]:
    return by_run(run_on_ranks(train_runs, 2, MCORE_RUNS, timeout=600), MCORE_RUNS)


@pytest.fixture(scope="module")
def fully_shard_results() -> dict[Run, list[dict]]:
    return by_run(run_on_ranks(train_runs, 2, FULLY_SHARD_RUNS, timeout=600), FULLY_SHARD_RUNS)


@pytest.fixture(scope="module")
def moe_results() -> dict[Run, list[dict]]:
    runs = [Run("mcore", "optim_grads_params")]
    return by_run(run_on_ranks(train_runs, 2, runs, True, timeout=600), runs)


@pytest.mark.multirank
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mcore_fully_sharded_data_parallel_gpt_matches_unsharded_reference(mcore_results, strategy):
    run = next(r for r in MCORE_RUNS if r.strategy == strategy)
    assert_matches_reference(mcore_results[run])


@pytest.mark.multirank
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_megatron_fsdp_fully_shard_model_gpt_matches_unsharded_reference(
    fully_shard_results, strategy
):
    run = next(r for r in FULLY_SHARD_RUNS if r.strategy == strategy)
    assert_matches_reference(fully_shard_results[run])


@pytest.mark.multirank
def test_moe_gpt_routes_experts_to_the_expert_muon_and_matches_reference(moe_results):
    (per_rank,) = moe_results.values()
    assert_matches_reference(per_rank)
    routing = {
        name: (optimizer, is_expert) for name, optimizer, is_expert in per_rank[0]["routing"]
    }
    experts = [n for n in routing if ".experts." in n]
    assert len(experts) == 2 * gpt_parity.NUM_EXPERTS * 2  # 2 layers x 4 experts x fc1/fc2
    for name in experts:
        assert routing[name] == ("muon", True), name
    for layer in range(2):
        assert routing[f"module.module.decoder.layers.{layer}.mlp.router.weight"] == ("muon", False)
    summary = per_rank[0]["summary"]
    assert [line.split(":")[0] for line in summary] == [
        "megatron-muon Muon[dense]",
        "megatron-muon Muon[expert]",
        "megatron-muon AdamW",
    ]
    assert "over expt_dp (2 ranks)" in summary[1]


def _strip(name: str) -> str:
    return name.removeprefix("module.module.")


EXPECTED_MUON = [
    f"decoder.layers.{layer}.{suffix}"
    for layer in range(2)
    for suffix in (
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
    )
]


@pytest.mark.multirank
def test_tiny_gpt_routing_table_by_name(mcore_results):
    per_rank = mcore_results[MCORE_RUNS[0]]
    routing = {_strip(n): (opt, expert) for n, opt, expert in per_rank[0]["routing"]}
    assert sorted(n for n, (opt, _) in routing.items() if opt == "muon") == sorted(EXPECTED_MUON)
    adam = sorted(n for n, (opt, _) in routing.items() if opt == "adam")
    assert "embedding.word_embeddings.weight" in adam
    # Stock megatron-core sends the learned position embedding to Muon (no tag): not here.
    assert "embedding.position_embeddings.weight" in adam
    assert "output_layer.weight" in adam
    assert all(n.endswith(("bias", "layernorm.weight")) for n in adam if "layers" in n)
    assert (
        len(adam) == 3 + 2 * 8 + 2
    )  # embeddings, output; per layer 4 biases + 2 norms x w/b; final
    assert not any(expert for _, expert in routing.values())
    for result in per_rank:
        assert result["routing"] == per_rank[0]["routing"]  # same on every rank


@pytest.mark.multirank
def test_summary_line_per_optimizer_names_counts_strategy_and_mode(mcore_results):
    for run in MCORE_RUNS:
        muon_line, adam_line = mcore_results[run][0]["summary"]
        assert muon_line == (
            "megatron-muon Muon[dense]: 8 params, 98,304 elements over dp_cp (2 ranks), "
            f"strategy {run.strategy}, mode {run.mode}, tp_mode blockwise"
        )
        assert (
            adam_line == f"megatron-muon AdamW: 21 params, 36,608 elements, strategy {run.strategy}"
        )


# --------------------------------------------------------------------------------------------------
# clear errors
# --------------------------------------------------------------------------------------------------


def test_unknown_optimizer_name_is_refused_with_the_known_names():
    from megatron_muon import build_muon_optimizer
    from megatron_muon.common.options import FsdpOptimizerT, OrthogonalizedOptimizerT

    known = sorted({*get_args(FsdpOptimizerT), *get_args(OrthogonalizedOptimizerT), "sgd"})
    assert {"muon", "soap", "psgd_pro", "laprop", "polargrad", "sgd"} <= set(known)
    # Adam on Megatron-FSDP is megatron-core's own (get_megatron_optimizer).
    with pytest.raises(
        ValueError, match=rf"builds optimizer\(s\) {re.escape(str(known))}.*optimizer='adam'"
    ):
        build_muon_optimizer(gpt_parity.optimizer_config(optimizer="adam"), [torch.nn.Linear(2, 2)])


def test_fp16_with_muon_is_refused():
    from megatron_muon import build_muon_optimizer

    config = gpt_parity.optimizer_config(fp16=True)
    with pytest.raises(ValueError, match="muon with fp16 is not supported"):
        build_muon_optimizer(config, [torch.nn.Linear(2, 2)])


def test_a_chunk_not_wrapped_by_megatron_fsdp_is_refused():
    from megatron_muon import build_muon_optimizer

    with pytest.raises(
        TypeError, match=r"model chunk 0 \(Linear\) is not wrapped by Megatron-FSDP"
    ):
        build_muon_optimizer(gpt_parity.optimizer_config(), [torch.nn.Linear(2, 2)])


def test_an_unknown_checkpoint_format_is_refused_before_anything_is_built():
    from megatron_muon import build_muon_optimizer

    with pytest.raises(ValueError, match=r"ckpt_format must be one of \['fsdp_dtensor'\].*'torch'"):
        build_muon_optimizer(
            gpt_parity.optimizer_config(), [torch.nn.Linear(2, 2)], ckpt_format="torch"
        )


def test_stopping_on_a_nonfinite_grad_norm_is_refused_without_megatron_checkpoints():
    from megatron_muon import build_muon_optimizer

    with pytest.raises(ValueError, match="stop_on_nonfinite_grad_norm applies to"):
        build_muon_optimizer(
            gpt_parity.optimizer_config(), [torch.nn.Linear(2, 2)], stop_on_nonfinite_grad_norm=True
        )


def _build_variants(rank: int, world_size: int) -> dict:
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_muon import build_muon_optimizer

    gpt_parity.init_megatron()
    wrapped = gpt_parity.wrap(gpt_parity.build_gpt(moe=True), Run("mcore", "optim"), world_size)
    config = gpt_parity.optimizer_config()
    out: dict = {}
    overrides = get_standard_config_overrides(config)
    overrides[ParamKey(name="*.final_layernorm.weight")] = {"optimizer": "muon"}
    try:
        build_muon_optimizer(config, [wrapped], config_overrides=overrides)
    except ValueError as error:
        out["not_a_matrix"] = str(error)
    mpu = ProcessGroupCollection.use_mpu_process_groups()
    without_expt_dp = ProcessGroupCollection(tp=mpu.tp, dp_cp=mpu.dp_cp, expt_tp=mpu.expt_tp)
    try:
        build_muon_optimizer(config, [wrapped], pg_collection=without_expt_dp)
    except ValueError as error:
        out["missing_expt_dp"] = str(error)

    # Lion as the scalar optimizer, and a matrix opted out of Muon with use_muon=False.
    named = dict(wrapped.named_parameters())
    named["module.module.decoder.layers.0.self_attention.linear_proj.weight"].use_muon = False
    lion = build_muon_optimizer(
        gpt_parity.optimizer_config(muon_scalar_optimizer="lion"), [wrapped]
    )
    out["lion_summary"] = lion.summary_lines
    out["lion_state_keys"] = sorted(
        {tuple(sorted(s)) for s in lion.chained_optimizers[-1].optimizer.state.values()}
    )
    out["lion_routing"] = {r.name: r.optimizer for r in lion.routing}

    # decoupled_lr (megatron-core's standard override) on embedding and output params.
    decoupled = build_muon_optimizer(gpt_parity.optimizer_config(decoupled_lr=5e-3), [wrapped])
    names = {id(p): gpt_parity._strip(n) for n, p in wrapped.named_parameters()}
    out["lr_by_param"] = {
        names[id(p)]: (group["lr"], group["max_lr"])
        for group in decoupled.param_groups
        for p in group["params"]
    }
    return out


@pytest.fixture(scope="module")
def variants() -> list[dict]:
    return run_on_ranks(_build_variants, 2, timeout=300)


@pytest.mark.multirank
def test_muon_param_that_is_not_a_matrix_and_missing_expt_dp_are_refused(variants):
    for messages in variants:
        assert (
            "decoder.final_layernorm.weight of shape (64,) is routed to Muon"
            in (messages["not_a_matrix"])
        )
        assert (
            "expert Muon params but pg_collection has no expt_dp group"
            in (messages["missing_expt_dp"])
        )


# --------------------------------------------------------------------------------------------------
# HSDP: 2 replicas x 2 shards on 4 ranks
# --------------------------------------------------------------------------------------------------

# One step; params within the reduction-order floor as above (AdamW's first update is ~lr * sign(g):
# output-layer elements with |g| near eps flip sign with the 4-rank reduction order, in the
# reordered reference as in the sharded run).


HSDP_RUNS = [Run("mcore_hsdp", "optim_grads_params"), Run("fully_shard_hsdp", "optim_grads_params")]


def _train_hsdp(rank: int, world_size: int) -> list[dict]:
    # megatron-core: num_distributed_optimizer_instances=2 (outer no_shard); megatron_fsdp: a
    # (outer, fsdp, tp) mesh. dp_cp spans all 4 ranks in both.
    gpt_parity.init_megatron(num_distributed_optimizer_instances=2)
    return [gpt_parity.train(run, rank, world_size, 1) for run in HSDP_RUNS]


@pytest.fixture(scope="module")
def hsdp_results() -> dict[Run, list[dict]]:
    return by_run(run_on_ranks(_train_hsdp, 4, timeout=600), HSDP_RUNS)


@pytest.mark.multirank
@pytest.mark.parametrize("wrapper", ["mcore_hsdp", "fully_shard_hsdp"])
def test_hsdp_outer_no_shard_matches_reference_with_muon_over_the_whole_dp_group(
    hsdp_results, wrapper
):
    per_rank = hsdp_results[next(r for r in HSDP_RUNS if r.wrapper == wrapper)]
    errors = gpt_parity.assert_within_floor(per_rank, per_rank[0]["floor"])
    worst = max(errors, key=errors.get)
    print(f"\n{per_rank[0]['summary']}\nlargest deviation: {worst} {errors[worst]:.2e}")
    for rank, result in enumerate(per_rank):
        assert len(result["stats"]) == 1
        # Replicated shards (outer no_shard) are counted once in the global grad norm;
        # floor-judged (tests/run_comparison.py).
        assert_steps_within_floor(f"{wrapper} rank {rank}", result["stats"], ("grad_norm",))
    assert per_rank[0]["summary"][0] == (
        "megatron-muon Muon[dense]: 8 params, 98,304 elements over dp_cp (4 ranks), strategy "
        "HSDP(outer no_shard, inner optim_grads_params), mode owner, tp_mode blockwise"
    )


@pytest.mark.multirank
def test_lion_scalar_optimizer_and_use_muon_false_route_as_megatron_does(variants):
    for result in variants:
        assert result["lion_summary"][-1].startswith("megatron-muon Lion: ")
        assert result["lion_state_keys"] == [("exp_avg",)]  # created at build, for every param
        routing = {gpt_parity._strip(n): opt for n, opt in result["lion_routing"].items()}
        assert routing["decoder.layers.0.self_attention.linear_proj.weight"] == "lion"
        assert routing["decoder.layers.1.self_attention.linear_proj.weight"] == "muon"
        assert routing["embedding.position_embeddings.weight"] == "lion"


# --------------------------------------------------------------------------------------------------
# no megatron-core process groups: the Megatron-FSDP module's own data-parallel group
# --------------------------------------------------------------------------------------------------


def _toy_without_parallel_state(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from megatron_muon import build_muon_optimizer
    from megatron_muon.engine.layout import local_tensor
    from tests.fsdp_models import ToyMLP, fully_shard_toy

    assert not parallel_state.model_parallel_is_initialized()
    torch.manual_seed(0)
    reference = ToyMLP()
    torch.manual_seed(0)
    wrapped = fully_shard_toy(ToyMLP(), world_size, "optim")
    named = dict(wrapped.named_parameters())
    optimizer = build_muon_optimizer(gpt_parity.optimizer_config(), [wrapped])
    weights = [p for n, p in reference.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in reference.named_parameters() if n.endswith("bias")]
    muon = TensorParallelMuon(
        weights,
        lr=gpt_parity.LR,
        momentum=gpt_parity.MOMENTUM,
        nesterov=True,
        weight_decay=gpt_parity.WEIGHT_DECAY,
        fp32_matmul_prec="highest",
        tp_mode="blockwise",
    )
    adamw = torch.optim.AdamW(biases, lr=gpt_parity.LR, betas=gpt_parity.BETAS, weight_decay=0.0)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(world_size * 4, 16, generator=generator)
        targets = torch.randn(world_size * 4, 16, generator=generator)
        muon.zero_grad()
        adamw.zero_grad()
        torch.nn.functional.mse_loss(reference(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), gpt_parity.CLIP_GRAD)
        muon.step()
        adamw.step()
        optimizer.zero_grad()
        mine = slice(rank * 4, (rank + 1) * 4)
        torch.nn.functional.mse_loss(wrapped(inputs[mine]), targets[mine]).backward()
        optimizer.step()
    errors = {}
    for name, ref in reference.named_parameters():
        param = named[f"module.{name}"]
        local = local_tensor(param.detach())
        row_numel = max(1, local.shape[1:].numel())
        start = 0 if local.shape == param.shape else param.megatron_fsdp_slice.start // row_numel
        rows = ref.detach()[start : start + local.shape[0]]
        errors[name] = float((local - rows).norm() / ref.detach().norm())
    return {"errors": errors, "summary": optimizer.summary_lines}


@pytest.mark.multirank
def test_without_parallel_state_the_megatron_fsdp_data_parallel_group_is_used():
    for result in run_on_ranks(_toy_without_parallel_state, 2, timeout=300):
        assert max(result["errors"].values()) <= TOLERANCE, result["errors"]
        assert "over Megatron-FSDP data-parallel group (2 ranks)" in result["summary"][0]


@pytest.mark.multirank
def test_decoupled_lr_reaches_the_embedding_and_output_groups(variants):
    for result in variants:
        lrs = result["lr_by_param"]
        assert lrs["embedding.word_embeddings.weight"] == (5e-3, 5e-3)
        assert lrs["output_layer.weight"] == (5e-3, 5e-3)
        # As in megatron-core: the position embedding carries no embedding/output tag.
        assert lrs["embedding.position_embeddings.weight"] == (gpt_parity.LR, gpt_parity.LR)
        assert lrs["decoder.layers.0.self_attention.linear_qkv.weight"] == (
            gpt_parity.LR,
            gpt_parity.LR,
        )

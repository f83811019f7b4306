"""Megatron-LM's loop beyond plain data parallelism: HSDP and expert parallelism on 4 CPU ranks,
each against a reference shown to be right; Megatron-LM's batch path; pipeline parallelism.

Every launch runs ``examples/pretrain_gpt_megatron.py``, whose ``get_batch`` is Megatron-LM's
(``.cuda(non_blocking=True)`` on the batch, then megatron-core's ``get_batch_on_this_tp_rank``,
``flatten_batch_for_packed_sequences``, ``get_batch_on_this_cp_rank``), with no logging flags:
what is printed here is what a user sees at Megatron's default log level.

The references, and why they are right:

- HSDP (2 replicas x 2-way ``optim`` sharding) against the 1-rank run (``muon_dp1``): the same
  global batch, so every iteration's loss and grad norm must be the same up to reduction order.
- EP=2 on 4 ranks (expert data-parallel group of 2) against **one rank without expert
  parallelism, continuing from the EP=2 run's own checkpoint**. Expert parallelism changes the
  initial weights (each EP rank draws only its own experts from the CPU generator), so no run
  without EP starts where an EP run starts; the ``fsdp_dtensor`` checkpoint names experts
  globally, so the 1-rank run resumes from exactly the EP=2 state (weights, Muon momentum of
  every expert) and then sees the same batches. One rank has no expert parallelism, no data
  parallelism and nothing to reduce: nothing in it can be mis-scaled.
- Not EP=2 on 2 ranks with twice the micro-batches: there the expert data-parallel group has one
  rank, and stock megatron-core 0.19.2's Megatron-FSDP mis-scales expert gradients under
  ``optim_grads``/``optim_grads_params`` with more than one micro-batch per rank (Adam too). Its
  gradient buffer for that group is not sharded, so ``fetch_bucket`` hands the accumulated buffer
  itself to ``gradient_reduce_preprocessing``, which multiplies it in place by ``1/DP`` at every
  micro-batch's reduction (param_and_grad_buffer.py:4048, :4070, :4751): with 2 micro-batches,
  ``g1/4 + g2/2`` instead of ``(g1 + g2)/2``. Measured from the same iteration-2 checkpoint:
  iteration-3 grad norm 1.673 instead of 1.712 and iteration-5 loss 3.760379 instead of 3.756262
  (the 1-rank run and the EP=2 x 4-rank run agree: 3.756261 / 3.756262); with ``optim``, or with
  one micro-batch per rank, the 2-rank EP=2 run equals the 1-rank run. The iteration-1 grad norm
  of a fresh start shows it the same way with Adam and Muon: 1.462 on 2 ranks, 1.555 on 4.

Noise: with ``--muon-fp32-matmul-prec high`` the runs above differed by at most 1 in the 7th
significant digit of the loss (relative 2.7e-7) and not at all in the printed grad norms. Each
comparison is **floor-judged** (tests/run_comparison.py: another reduction order): every
iteration's printed loss and full-precision grad norm within ``FLOOR_FACTOR`` times what the
reference run with every weight one ulp up grew to by then: HSDP against ``muon_dp1_floor`` (one
launch a session, shared with tests/test_megatron_lm_loop.py), EP against the one-rank run from
the EP=2 checkpoint again, nudged after the load (one more one-rank launch for each model).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.megatron_lm_logs import assert_loss_falls, printed_lines
from tests.run_comparison import assert_resumed_within_floor, assert_runs_within_floor, floor_run
from tests.torchrun import EP_ITERS, MLA_FLAGS, MOE_FLAGS, MUON_FLAGS, MegatronRun, run_megatron

pytestmark = [pytest.mark.timeout(900), pytest.mark.multirank]

HSDP_FLAGS = [
    *("--data-parallel-sharding-strategy", "optim"),
    *("--num-distributed-optimizer-instances", "2"),
]
EP_SAVE_AT = 2


# --------------------------------------------------------------------------------------------------
# HSDP
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hsdp_run() -> MegatronRun:
    """Muon, HSDP on 4 ranks (2 replicas of 2-way ``optim``), without ``--overlap-grad-reduce``."""
    return run_megatron([*MUON_FLAGS, *HSDP_FLAGS], nproc=4)


def test_hsdp_without_overlap_grad_reduce_trains_exactly_as_one_rank(
    hsdp_run: MegatronRun, muon_dp1: MegatronRun, muon_dp1_floor: MegatronRun
) -> None:
    """Floor-judged (module docstring)."""
    # Stock megatron-core 0.19.2 never all-reduces across the replicas without the flag (this
    # run then printed iteration-1 grad norm 1.197, the 1-rank run 2.002; Adam: 1.103): install()
    # turns --overlap-grad-reduce on and warns on rank 0.
    warning = "turning --overlap-grad-reduce on"
    assert warning in hsdp_run.rank_outputs[0]
    assert not any(warning in hsdp_run.rank_outputs[rank] for rank in (1, 2, 3))
    losses = hsdp_run.series("lm loss")
    print(f"\nHSDP 2x2 lm loss: {losses}\n   DP=1 lm loss: {muon_dp1.series('lm loss')}")
    assert_loss_falls(losses)
    assert_runs_within_floor("muon HSDP 2x2 vs DP=1", hsdp_run, muon_dp1, muon_dp1_floor)


def test_validate_args_turns_on_overlap_grad_reduce_for_muon_with_hsdp_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from megatron.training import arguments

    from megatron_muon.integrations import megatron_lm

    megatron_lm.install(cpu_stand_ins=False)
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    base = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 4 "
        "--train-iters 5 --lr 0.01 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
        "--no-gradient-accumulation-fusion --use-megatron-fsdp --ckpt-format fsdp_dtensor "
        "--data-parallel-sharding-strategy optim "
    )

    def overlap(flags: str) -> bool:
        monkeypatch.setattr(sys, "argv", ["pretrain", *(base + flags).split()])
        return arguments.validate_args(arguments.parse_args()).overlap_grad_reduce

    with pytest.warns(UserWarning, match="turning --overlap-grad-reduce on"):
        assert overlap("--optimizer muon --num-distributed-optimizer-instances 2")
    assert not overlap("--optimizer muon")  # no HSDP: left as given
    assert not overlap("--optimizer adam --num-distributed-optimizer-instances 2")  # stock


# --------------------------------------------------------------------------------------------------
# what the user sees at Megatron's default log level
# --------------------------------------------------------------------------------------------------


def test_build_summary_is_printed_on_rank_0_at_megatrons_default_log_level(
    hsdp_run: MegatronRun,
) -> None:
    dense = printed_lines(hsdp_run, 0, "megatron-muon Muon[dense]: ")
    adamw = printed_lines(hsdp_run, 0, "megatron-muon AdamW: ")
    assert len(dense) == 1 and len(adamw) == 1, hsdp_run.rank_outputs[0][-3000:]
    assert "over dp_cp (4 ranks)" in dense[0]
    assert "HSDP(outer no_shard, inner optim)" in dense[0]
    for rank in (1, 2, 3):
        assert not printed_lines(hsdp_run, rank, "megatron-muon ")


# --------------------------------------------------------------------------------------------------
# expert parallelism
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ep_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ep2_ckpt")


class EpRuns(NamedTuple):
    """EP=2 on 4 ranks (saving at iteration 2); 1 rank without EP resuming from that save; the
    same again with every weight one ulp up after the load (its floor)."""

    ep2: MegatronRun
    one_rank: MegatronRun
    one_rank_floor: MegatronRun


def _ep_runs(checkpoint: Path, model_flags: list[str]) -> EpRuns:
    save = ["--save", str(checkpoint), "--save-interval", str(EP_SAVE_AT)]
    flags = [*MOE_FLAGS, *model_flags]
    ep2 = run_megatron([*flags, "--expert-model-parallel-size", "2", *save], nproc=4)
    resume = [*flags, *_load_ep_checkpoint(checkpoint)]
    return EpRuns(ep2, run_megatron(resume, nproc=1), floor_run(resume, nproc=1))


@pytest.fixture(scope="module")
def ep_runs(ep_checkpoint: Path) -> EpRuns:
    return _ep_runs(ep_checkpoint, [])


@pytest.fixture(scope="module")
def mla_ep_runs(tmp_path_factory: pytest.TempPathFactory) -> EpRuns:
    """The same launches with multi-latent attention and MuonClip on it (``MLA_FLAGS``)."""
    return _ep_runs(tmp_path_factory.mktemp("mla_ep2_ckpt"), MLA_FLAGS)


@pytest.fixture(params=["ep_runs", "mla_ep_runs"], ids=["gqa", "mla"])
def either_ep_runs(request: pytest.FixtureRequest) -> EpRuns:
    return request.getfixturevalue(request.param)


def _load_ep_checkpoint(checkpoint: Path) -> list[str]:
    return ["--load", str(checkpoint), "--ckpt-step", str(EP_SAVE_AT), "--no-load-rng"]


def test_expert_parallel_muon_on_4_ranks_equals_one_rank_from_the_same_state(
    either_ep_runs: EpRuns,
) -> None:
    """Floor-judged (module docstring)."""
    ep2, one_rank, floor = either_ep_runs
    print(f"\nEP=2 x 4 ranks lm loss: {ep2.series('lm loss')}")
    print(f"1 rank from iter {EP_SAVE_AT}: {one_rank.series('lm loss')}")
    assert sorted(ep2.iterations) == list(range(1, EP_ITERS + 1))
    assert sorted(one_rank.iterations) == list(range(EP_SAVE_AT + 1, EP_ITERS + 1))
    assert_loss_falls(ep2.series("lm loss"), EP_ITERS)
    # Experts went to Muon over the expert data-parallel group (2 ranks at EP=2 on 4 ranks).
    expert = printed_lines(ep2, 0, "megatron-muon Muon[expert]: ")
    assert len(expert) == 1 and "over expt_dp (2 ranks)" in expert[0], expert
    # The second logged loss after the load is Megatron's mean of two iterations' losses.
    label = f"1 rank from iteration {EP_SAVE_AT} vs EP=2 x 4 ranks"
    assert_resumed_within_floor(label, one_rank, ep2, floor, one_rank)


def test_an_ep2_checkpoint_of_4_ranks_resumes_at_ep2_on_2_ranks(
    ep_runs: EpRuns, ep_checkpoint: Path
) -> None:
    """Floor-judged (module docstring), against the floor of the one-rank run from the same
    checkpoint (the same iterations, optimizer and model: no launch of its own)."""
    # DP reshard at fixed EP: saved at EP=2 x DP=4 (expert DP 2), loaded at EP=2 x DP=2 (expert
    # DP 1) with one micro-batch per rank (the same global batch; more than one would hit the
    # stock expert-gradient scaling bug of a single-rank expert DP group, module docstring).
    ep2, one_rank, floor = ep_runs
    flags = [*MOE_FLAGS, "--expert-model-parallel-size", "2", "--micro-batch-size", "2"]
    resumed = run_megatron([*flags, *_load_ep_checkpoint(ep_checkpoint)], nproc=2)
    print(f"\nEP=2 on 2 ranks from iter {EP_SAVE_AT}: {resumed.series('grad norm')}")
    assert sorted(resumed.iterations) == list(range(EP_SAVE_AT + 1, EP_ITERS + 1))
    label = "EP=2 2 ranks resumed vs 4 ranks"
    assert_resumed_within_floor(label, resumed, ep2, floor, one_rank)


def test_qk_clip_lines_are_printed_on_rank_0_when_heads_are_clipped(
    either_ep_runs: EpRuns,
) -> None:
    ep2, one_rank, _ = either_ep_runs
    clipped = printed_lines(ep2, 0, "QK-clip: ")
    print("\n" + "\n".join(clipped))
    assert clipped and all("heads clipped" in line for line in clipped), clipped
    # After the resume the 1-rank run clips the same heads at the same steps as the EP run.
    resumed = printed_lines(one_rank, 0, "QK-clip: ")
    assert resumed and resumed == clipped[-len(resumed) :], (resumed, clipped)
    for rank in (1, 2, 3):
        assert not printed_lines(ep2, rank, "QK-clip: ")


# --------------------------------------------------------------------------------------------------
# Megatron-LM's batch path with a TP broadcast, and pipeline parallelism (gloo ranks, in-process)
# --------------------------------------------------------------------------------------------------


def _batch_on_tp_ranks(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from megatron.core import mpu, parallel_state
    from megatron.core.utils import (
        flatten_batch_for_packed_sequences,
        get_batch_on_this_cp_rank,
        get_batch_on_this_tp_rank,
    )

    from megatron_muon import cpu_stand_ins

    cpu_stand_ins.install_for_training()  # Tensor.cuda() as Megatron-LM's get_batch calls it
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    batch: dict = {}
    if rank == 0:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 128, (2, 16), generator=generator)
        batch = {
            "tokens": tokens,
            "labels": tokens.roll(-1, dims=1),
            "loss_mask": torch.ones(2, 16),
            "position_ids": torch.arange(16).repeat(2, 1),
        }
        for key in ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
            batch[key] = None
        batch = {k: v.cuda(non_blocking=True) if v is not None else None for k, v in batch.items()}
    batch = get_batch_on_this_tp_rank(
        batch,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=False,
        cp_size=1,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        micro_batch_size=2,
        seq_length=16,
        mtp_on_this_rank=False,
    )
    batch = flatten_batch_for_packed_sequences(batch)
    batch = get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group()
    )
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}


def test_megatron_lm_batch_path_broadcasts_the_batch_to_every_tp_rank_on_cpu() -> None:
    batches = run_on_ranks(_batch_on_tp_ranks, 2, timeout=120)
    assert set(batches[0]) == {"tokens", "labels", "loss_mask", "position_ids"}
    for key, tensor in batches[0].items():
        assert tensor.device.type == "cpu"
        assert torch.equal(batches[1][key], tensor), key


def _wrap_a_pipeline_stage(rank: int, world_size: int) -> str:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_model_parallel_size=world_size,
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=128,
        max_sequence_length=32,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    ddp_config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params",
        use_megatron_fsdp=True,
        gradient_reduce_div_fusion=False,
    )
    try:
        FullyShardedDataParallel(config, ddp_config, model, device=torch.device("cpu"))
    except Exception as error:  # noqa: BLE001  (the stock failure is what is checked)
        return f"{type(error).__name__}: {error}"
    return "wrapped"


def test_megatron_fsdp_of_megatron_core_cannot_wrap_a_pipeline_stage() -> None:
    # Stock megatron-core 0.19.2 lays the whole world out as dp_cp x ep x tp when it builds the
    # Megatron-FSDP mesh (mcore_fsdp_adapter.py:561), so with 2 pipeline stages the wrapper fails
    # before any optimizer exists, Adam or Muon; when a release can, this test fails and the
    # table in docs/parallelism.md must be revisited.
    outcomes = run_on_ranks(_wrap_a_pipeline_stage, 2, timeout=120)
    for outcome in outcomes:
        assert "(dp_cp ep tp) -> ep dp_cp tp" in outcome, outcome

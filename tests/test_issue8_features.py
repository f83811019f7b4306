"""Issue 8's features through the factory (``build_muon_optimizer``) on a tiny megatron-core GPT
under Megatron-FSDP (megatron-core's ``FullyShardedDataParallel``, ``optim_grads_params``, gloo):

- QK-clip (``MuonFsdpConfig.qk_clip_threshold``): on 2 ranks, every param equals an unsharded
  reference (``TensorParallelMuon`` + AdamW on full tensors, then ``QKClip`` on the full weights)
  and the wrapper reports the same number of clipped heads as the reference, every step;
- Gram Newton-Schulz (``ns_method="gram"``, fp32 "highest"): the 2-rank run matches the 1-rank
  run with the same method to within the gradient reduction-order deviation that standard NS shows
  between its own 2-rank and 1-rank runs (amplified ~2.5x by Gram NS; numbers in the test), and
  differs from standard NS (it really ran);
- momentum offload (``offload_momentum=True``): bitwise equal to the run without offload over
  several steps, and after ``save_checkpoint`` / ``load_checkpoint`` into a fresh model and
  optimizer the resumed run is still bitwise equal to the uninterrupted one.

Plus the flags: ``add_muon_args`` + ``MuonFsdpConfig.from_args`` on our parser and on a parser that
already has Megatron-LM's ``--qk-clip`` / ``--qk-clip-threshold``.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests import gpt_parity
from tests.gpt_parity import SEQ, Run
from tests.harness import run_on_ranks

RUN = Run(wrapper="mcore", strategy="optim_grads_params")
NUM_STEPS = 3
# Among the tiny GPT's per-head max logits (0.07-0.21 over the first 3 steps without clipping), so
# some heads are clipped at every step and others not.
QK_CLIP_THRESHOLD = 0.12
TOLERANCE = 1e-5  # as tests/test_factory.py: fp32, 2-rank reduction order vs one process
GRAM_TOLERANCE = 1e-6  # fp32 "highest": absolute slack on Gram NS's DP=2 vs DP=1 deviation


def _build(world_size: int, fsdp_kwargs: dict):
    """(wrapped GPT, its optimizer params by name, factory-built optimizer)."""
    from megatron_muon import MuonFsdpConfig, build_muon_optimizer

    wrapped = gpt_parity.wrap(gpt_parity.build_gpt(), RUN, world_size)
    named = dict(wrapped.named_parameters())  # the optimizer params, right after wrapping
    optimizer = build_muon_optimizer(
        gpt_parity.optimizer_config(), [wrapped], fsdp_config=MuonFsdpConfig(**fsdp_kwargs)
    )
    return wrapped, named, optimizer


def _step(wrapped, optimizer, step: int, rank: int, world_size: int) -> None:
    """One step on this rank's share of ``batch(step, 2)`` (the same data at DP=1 and DP=2)."""
    tokens, labels = gpt_parity.batch(step, 2)
    mine = tokens.view(world_size, -1, SEQ)[rank], labels.view(world_size, -1, SEQ)[rank]
    optimizer.zero_grad()
    gpt_parity.loss_of(wrapped, *mine).backward()
    ok, _, _ = optimizer.step()
    assert ok


def _rows(named: dict) -> dict[str, tuple[int, torch.Tensor]]:
    """name -> (first row, this rank's rows) of every optimizer param."""
    from megatron_muon.layout import local_tensor

    out = {}
    for name, param in named.items():
        local = local_tensor(param.detach()).clone()
        row_numel = max(1, local.shape[1:].numel())
        full_rows = tuple(local.shape) == tuple(param.shape)
        start = 0 if full_rows else param.megatron_fsdp_slice.start // row_numel
        out[gpt_parity._strip(name)] = (start, local)
    return out


def _assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The full tensors from the ranks' row pieces."""
    full = {}
    for name in per_rank[0]:
        pieces = sorted({(r[name][0], r[name][1].shape[0]): r[name][1] for r in per_rank}.items())
        full[name] = torch.cat([rows for (_, _), rows in pieces])
    return full


# --------------------------------------------------------------------------------------------------
# QK-clip
# --------------------------------------------------------------------------------------------------


def _qk_clip_parity(rank: int, world_size: int) -> dict:
    from megatron_muon.qk_clip import QKClip, find_self_attentions

    gpt_parity.init_megatron()
    reference = gpt_parity.Reference(gpt_parity.build_gpt())
    reference_clip = QKClip(find_self_attentions([reference.model]), QK_CLIP_THRESHOLD)
    wrapped, named, optimizer = _build(world_size, {"qk_clip_threshold": QK_CLIP_THRESHOLD})
    counts = []
    for step in range(NUM_STEPS):
        tokens, labels = gpt_parity.batch(step, world_size)
        reference.step(tokens, labels)
        reference_stats = reference_clip.clip()
        _step(wrapped, optimizer, step, rank, world_size)
        counts.append(
            (
                optimizer.last_qk_clip.num_clipped_heads,
                reference_stats.num_clipped_heads,
                optimizer.last_qk_clip.max_logit,
                reference_stats.max_logit,
            )
        )
    return {
        "deviations": gpt_parity.deviations(optimizer, named, reference.model),
        "counts": counts,
        "summary": list(optimizer.summary_lines),
    }


@pytest.fixture(scope="module")
def qk_clip_results() -> list[dict]:
    return run_on_ranks(_qk_clip_parity, 2, timeout=300)


@pytest.mark.multirank
def test_qk_clip_from_the_factory_clips_the_heads_an_unsharded_reference_clips(qk_clip_results):
    errors = gpt_parity.relative_errors([r["deviations"] for r in qk_clip_results])
    for name, error in errors.items():
        assert error <= TOLERANCE, f"{name}: relative error {error:.2e}"
    for result in qk_clip_results:
        for step, (mine, reference, max_logit, reference_max) in enumerate(result["counts"]):
            assert mine == reference, f"step {step}: {mine} heads clipped, reference {reference}"
            assert max_logit == pytest.approx(reference_max, rel=1e-5), step
    counts = [c[0] for c in qk_clip_results[0]["counts"]]
    # 2 layers x 4 heads: some heads are clipped at every step, never all.
    assert all(0 < count < 8 for count in counts), counts
    print(f"\nQK-clip heads clipped per step (of 8): {counts}; worst {max(errors.values()):.1e}")


@pytest.mark.multirank
def test_qk_clip_summary_line_names_the_threshold(qk_clip_results):
    assert any(
        "QK-clip: threshold 0.12 on 2 attention layers" in line
        for line in qk_clip_results[0]["summary"]
    )


# --------------------------------------------------------------------------------------------------
# Gram Newton-Schulz
# --------------------------------------------------------------------------------------------------


def _final_rows(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    gpt_parity.init_megatron()
    out = []
    for fsdp_kwargs in runs:
        wrapped, named, optimizer = _build(world_size, fsdp_kwargs)
        after_step = []
        for step in range(NUM_STEPS):
            _step(wrapped, optimizer, step, rank, world_size)
            after_step.append(_rows(named))
        muon = optimizer.chained_optimizers[0].optimizer
        out.append(
            {
                "after_step": after_step,
                "rows": after_step[-1],
                "ns_method": muon.ns_config.ns_method,
                "muon": [
                    gpt_parity._strip(r.name) for r in optimizer.routing if r.optimizer == "muon"
                ],
            }
        )
    return out


@pytest.mark.multirank
def test_gram_newton_schulz_on_two_ranks_matches_one_rank_as_closely_as_standard_ns_does():
    runs = [{"ns_method": "gram"}, {"ns_method": "standard"}]
    two = run_on_ranks(_final_rows, 2, runs, timeout=300)
    one = run_on_ranks(_final_rows, 1, runs, timeout=300)
    assert [r["ns_method"] for r in one[0]] == ["gram", "standard"]
    assert all(r[0]["ns_method"] == "gram" for r in two)
    muon_names = one[0][0]["muon"]
    assert len(muon_names) == 8, muon_names  # linear_qkv, linear_proj, fc1, fc2 of 2 layers
    by_step, differs = [], set()
    for step in range(NUM_STEPS):
        two_full = [_assemble([r[i]["after_step"][step] for r in two]) for i in range(2)]
        worst = {"gram": 0.0, "standard": 0.0}
        for name in muon_names:
            for index, method in enumerate(("gram", "standard")):
                expected = one[0][index]["after_step"][step][name][1]
                difference = (two_full[index][name] - expected).norm()
                worst[method] = max(worst[method], float(difference / expected.norm()))
            # linear_proj (64 x 64) is square: Gram NS falls back to standard NS there.
            if not torch.equal(two_full[0][name], two_full[1][name]):
                differs.add(name)
        by_step.append(worst)
    assert any("linear_fc1" in name for name in differs), f"gram == standard except {differs}"
    print(f"\nMuon params, DP=2 vs DP=1 largest relative error after each step: {by_step}")
    # DP=2 and DP=1 differ before NS: the 2-rank averaged gradient's fp32 reduction order. NS
    # amplifies it (the momentum's small singular directions), standard NS to ~4e-6 in the weights
    # after one step on this model, Gram NS ~2.5x more (X X^T squares the singular values);
    # later steps compound it through AdamW's embeddings. Measured: gram 8.9e-6 / 1.2e-5 / 1.3e-5,
    # standard 3.8e-6 / 4.7e-6 / 4.9e-6 after steps 1-3. So 1e-6 is out of reach through the whole
    # model; what this checks is that Gram NS on shards adds no error beyond that amplification.
    for worst in by_step:
        assert worst["gram"] <= 2 * TOLERANCE, by_step
        assert worst["gram"] <= 4 * worst["standard"] + GRAM_TOLERANCE, by_step


# --------------------------------------------------------------------------------------------------
# momentum offload
# --------------------------------------------------------------------------------------------------


def _offload_and_resume(rank: int, world_size: int, path: str) -> dict:
    from megatron_muon.checkpointing import load_checkpoint, save_checkpoint

    gpt_parity.init_megatron()
    total = 2 * NUM_STEPS
    wrapped, named, optimizer = _build(world_size, {})
    for step in range(total):
        _step(wrapped, optimizer, step, rank, world_size)
    plain = _rows(named)

    wrapped, named, optimizer = _build(world_size, {"offload_momentum": True})
    muon = optimizer.chained_optimizers[0].optimizer
    for step in range(NUM_STEPS):
        _step(wrapped, optimizer, step, rank, world_size)
    momentum_device = {str(s["momentum_buffer"].device) for s in muon.state.values()}
    save_checkpoint(path, [wrapped], optimizer, iteration=NUM_STEPS)
    for step in range(NUM_STEPS, total):
        _step(wrapped, optimizer, step, rank, world_size)
    offloaded = _rows(named)

    wrapped, named, optimizer = _build(world_size, {"offload_momentum": True})
    first = load_checkpoint(path, [wrapped], optimizer).iteration
    for step in range(first, total):
        _step(wrapped, optimizer, step, rank, world_size)
    resumed = _rows(named)
    return {
        "plain": plain,
        "offloaded": offloaded,
        "resumed": resumed,
        "offload": muon.offload_momentum,
        "momentum_device": momentum_device,
    }


@pytest.mark.multirank
def test_momentum_offload_is_bitwise_equal_to_no_offload_and_resumes_bitwise(tmp_path):
    results = run_on_ranks(_offload_and_resume, 2, str(tmp_path / "ckpt"), timeout=300)
    for rank, result in enumerate(results):
        assert result["offload"] is True
        assert result["momentum_device"] == {"cpu"}
        for name, (start, rows) in result["plain"].items():
            assert torch.equal(result["offloaded"][name][1], rows), f"rank {rank} {name} offload"
            assert torch.equal(result["resumed"][name][1], rows), f"rank {rank} {name} resume"
            assert result["resumed"][name][0] == start


# --------------------------------------------------------------------------------------------------
# flags
# --------------------------------------------------------------------------------------------------


def test_our_flags_reach_the_fsdp_config():
    from megatron_muon.arguments import add_muon_args
    from megatron_muon.config import MuonFsdpConfig

    parser = add_muon_args(argparse.ArgumentParser())
    default = MuonFsdpConfig.from_args(parser.parse_args([]))
    assert default == MuonFsdpConfig()
    assert default.qk_clip_threshold is None
    args = parser.parse_args(
        [
            "--muon-ns-method=gram",
            "--muon-gram-half-dtype=bfloat16",
            "--muon-gram-restarts",
            "2",
            "--muon-offload-momentum",
            "--qk-clip-threshold=50",
        ]
    )
    config = MuonFsdpConfig.from_args(args)
    assert config == MuonFsdpConfig(
        ns_method="gram",
        gram_half_dtype="bfloat16",
        gram_restarts=(2,),
        offload_momentum=True,
        qk_clip_threshold=50.0,
    )
    assert config.sharded_muon_kwargs()["gram_half_dtype"] == "bfloat16"
    assert "qk_clip_threshold" not in config.sharded_muon_kwargs()
    with pytest.raises(ValueError, match="-3"):
        MuonFsdpConfig.from_args(parser.parse_args(["--qk-clip-threshold=-3"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--muon-gram-half-dtype=float32"])


def test_on_megatrons_parser_qk_clip_follows_its_qk_clip_switch_and_threshold():
    from megatron_muon.arguments import add_muon_args
    from megatron_muon.config import MuonFsdpConfig

    parser = argparse.ArgumentParser()  # Megatron-LM's three flags, as megatron.training has them
    parser.add_argument("--qk-clip", action="store_true")
    parser.add_argument("--qk-clip-threshold", type=float, default=100)
    parser.add_argument("--qk-clip-alpha", type=float, default=0.5)
    add_muon_args(parser)
    assert MuonFsdpConfig.from_args(parser.parse_args([])).qk_clip_threshold is None
    on = parser.parse_args(["--qk-clip", "--qk-clip-threshold=30"])
    assert MuonFsdpConfig.from_args(on).qk_clip_threshold == 30.0
    assert MuonFsdpConfig.from_args(parser.parse_args(["--qk-clip"])).qk_clip_threshold == 100.0


def test_megatron_lm_integration_takes_over_qk_clip_for_muon_with_megatron_fsdp():
    from megatron_muon.config import qk_clip_threshold
    from megatron_muon.integrations.megatron_lm_arguments import _take_over_qk_clip

    args = argparse.Namespace(qk_clip=True, qk_clip_threshold=20.0, qk_clip_alpha=0.5)
    _take_over_qk_clip(args)
    # Megatron's train_step then never calls its clip_qk; ours clips at Megatron's threshold.
    assert args.qk_clip is False and args.muon_qk_clip is True
    assert qk_clip_threshold(args) == 20.0
    off = argparse.Namespace(qk_clip=False, qk_clip_threshold=100.0)
    _take_over_qk_clip(off)
    assert qk_clip_threshold(off) is None


def test_bad_config_values_are_refused_by_name():
    from megatron_muon.config import MuonFsdpConfig

    with pytest.raises(ValueError, match="'float32'"):
        MuonFsdpConfig(gram_half_dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0.0"):
        MuonFsdpConfig(qk_clip_threshold=0.0)

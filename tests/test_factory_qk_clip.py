"""QK-clip (``QKClipConfig``) through the factory (``build_muon_optimizer``) on
a tiny megatron-core GPT under Megatron-FSDP (``tests/factory_gpt_runs.py``), with GQA-style
``SelfAttention`` and with bias-free Multi-Latent Attention (``gpt_parity.MLA_CONFIG``): on 2 ranks,
every param equals an unsharded reference (``TensorParallelMuon`` + AdamW on full tensors, then
``QKClip`` on the full weights) and the wrapper reports the same number of clipped heads as the
reference, every step; the max logits it reports are **floor-judged** against the reference's
(tests/run_comparison.py: the floor is the reference with its batch gradient accumulated rank by
rank, in the same launch).
"""

from __future__ import annotations

import pytest

from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.factory_gpt_runs import NUM_STEPS, _build, _step
from tests.run_comparison import FULL_PRECISION_GUARD, assert_within_floor

# Among each tiny GPT's per-head max logits over the first 3 steps without clipping (GQA
# 0.07-0.21: some heads are clipped at every step, others not; MLA 0.024-0.038, 0.080-0.100,
# 0.142-0.211: none at step 1, some but not all at step 2).
THRESHOLDS = {"gqa": 0.12, "mla": 0.09}


def _qk_clip_parity(rank: int, world_size: int, attention: str) -> dict:
    from megatron_muon.fsdp.qk_clip import QKClip, QKClipConfig, find_attentions
    from megatron_muon.integrations import local_core_attention

    local_core_attention.patch()
    gpt_parity.init_megatron()
    threshold, build = THRESHOLDS[attention], {"mla": attention == "mla"}
    reference = gpt_parity.Reference(gpt_parity.build_gpt(**build))
    reference_clip = QKClip(find_attentions([reference.model]), threshold)
    # The reduction-order floor: the reference with its batch gradient accumulated rank by rank.
    reordered = gpt_parity.Reference(gpt_parity.build_gpt(**build))
    reordered_clip = QKClip(find_attentions([reordered.model]), threshold)
    wrapped, named, optimizer = _build(
        world_size, {}, qk_clip=QKClipConfig(threshold=threshold), **build
    )
    counts = []
    for step in range(NUM_STEPS):
        tokens, labels = gpt_parity.batch(step, world_size)
        reference.step(tokens, labels)
        reference_stats = reference_clip.clip()
        reordered.step(tokens, labels, num_chunks=world_size)
        reordered_stats = reordered_clip.clip()
        _step(wrapped, optimizer, step, rank, world_size)
        counts.append(
            (
                optimizer.last_qk_clip.num_clipped_heads,
                reference_stats.num_clipped_heads,
                float(optimizer.last_qk_clip.max_logit),
                float(reference_stats.max_logit),
                float(reordered_stats.max_logit),
            )
        )
    return {
        "deviations": gpt_parity.deviations(optimizer, named, reference.model),
        "floor": gpt_parity.reduction_order_floor(reordered.model, reference.model),
        "counts": counts,
        "summary": list(optimizer.summary_lines),
        "threshold": threshold,
    }


@pytest.fixture(scope="module", params=["gqa", "mla"])
def qk_clip_results(request: pytest.FixtureRequest) -> list[dict]:
    return run_on_ranks(_qk_clip_parity, 2, request.param, timeout=300)


@pytest.mark.multirank
def test_qk_clip_from_the_factory_clips_the_heads_an_unsharded_reference_clips(qk_clip_results):
    errors = gpt_parity.assert_within_floor(qk_clip_results, qk_clip_results[0]["floor"])
    for rank, result in enumerate(qk_clip_results):
        for step, (mine, reference, *_) in enumerate(result["counts"]):
            assert mine == reference, f"step {step}: {mine} heads clipped, reference {reference}"
        max_logits = [
            {step: values[i] for step, values in enumerate(result["counts"], start=1)}
            for i in (2, 3, 4)
        ]
        assert_within_floor(f"rank {rank} max logit", *max_logits, guard=FULL_PRECISION_GUARD)
    counts = [c[0] for c in qk_clip_results[0]["counts"]]
    # 2 layers x 4 heads: some step clips some heads but not all.
    assert any(0 < count < 8 for count in counts), counts
    print(f"\nQK-clip heads clipped per step (of 8): {counts}; worst {max(errors.values()):.1e}")


@pytest.mark.multirank
def test_qk_clip_summary_line_names_the_threshold(qk_clip_results):
    threshold = qk_clip_results[0]["threshold"]
    assert any(
        f"QK-clip: threshold {threshold:g} on 2 attention layers" in line
        for line in qk_clip_results[0]["summary"]
    )

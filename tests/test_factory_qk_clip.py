"""QK-clip (``MuonFsdpConfig.qk_clip_threshold``) through the factory (``build_muon_optimizer``) on
a tiny megatron-core GPT under Megatron-FSDP (``tests/factory_gpt_runs.py``): on 2 ranks, every
param equals an unsharded reference (``TensorParallelMuon`` + AdamW on full tensors, then
``QKClip`` on the full weights) and the wrapper reports the same number of clipped heads as the
reference, every step.
"""

from __future__ import annotations

import pytest

from tests import gpt_parity
from tests.factory_gpt_runs import NUM_STEPS, _build, _step
from tests.harness import run_on_ranks

# Among the tiny GPT's per-head max logits (0.07-0.21 over the first 3 steps without clipping), so
# some heads are clipped at every step and others not.
QK_CLIP_THRESHOLD = 0.12


def _qk_clip_parity(rank: int, world_size: int) -> dict:
    from megatron_muon.qk_clip import QKClip, find_self_attentions

    gpt_parity.init_megatron()
    reference = gpt_parity.Reference(gpt_parity.build_gpt())
    reference_clip = QKClip(find_self_attentions([reference.model]), QK_CLIP_THRESHOLD)
    # The reduction-order floor: the reference with its batch gradient accumulated rank by rank.
    reordered = gpt_parity.Reference(gpt_parity.build_gpt())
    reordered_clip = QKClip(find_self_attentions([reordered.model]), QK_CLIP_THRESHOLD)
    wrapped, named, optimizer = _build(world_size, {"qk_clip_threshold": QK_CLIP_THRESHOLD})
    counts = []
    for step in range(NUM_STEPS):
        tokens, labels = gpt_parity.batch(step, world_size)
        reference.step(tokens, labels)
        reference_stats = reference_clip.clip()
        reordered.step(tokens, labels, num_chunks=world_size)
        reordered_clip.clip()
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
        "floor": gpt_parity.reduction_order_floor(reordered.model, reference.model),
        "counts": counts,
        "summary": list(optimizer.summary_lines),
    }


@pytest.fixture(scope="module")
def qk_clip_results() -> list[dict]:
    return run_on_ranks(_qk_clip_parity, 2, timeout=300)


@pytest.mark.multirank
def test_qk_clip_from_the_factory_clips_the_heads_an_unsharded_reference_clips(qk_clip_results):
    errors = gpt_parity.assert_within_floor(qk_clip_results, qk_clip_results[0]["floor"])
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

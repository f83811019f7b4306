"""Multi-Latent Attention on CPU ranks: the local spec builds (RoPE stand-in, the local core
attention's ``k_channels`` / ``v_channels`` patch), trains under Megatron-FSDP with
``build_muon_optimizer`` exactly as the unsharded reference does (MuonClip on MLA:
``tests/test_mla_qk_clip.py``, ``tests/test_factory_qk_clip.py``): params within
``gpt_parity.FLOOR_FACTOR`` of the reordered reference's floor, losses **floor-judged** against it
(tests/run_comparison.py).
"""

from __future__ import annotations

import pytest

from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.gpt_parity import Run
from tests.run_comparison import assert_steps_within_floor

NUM_STEPS = 3
RUNS = [Run("mcore", "optim_grads_params"), Run("mcore", "optim_grads", num_microbatches=2)]


def _train_mla(rank: int, world_size: int, q_lora_rank: int | None) -> list[dict]:
    from megatron_muon.integrations import local_core_attention

    local_core_attention.patch()
    gpt_parity.init_megatron()
    return [
        gpt_parity.train(run, rank, world_size, NUM_STEPS, mla=True, q_lora_rank=q_lora_rank)
        for run in RUNS
    ]


@pytest.mark.multirank
@pytest.mark.parametrize("q_lora_rank", [None, 32], ids=["no-q-lora", "q-lora"])
def test_mla_gpt_under_megatron_fsdp_matches_the_unsharded_reference(q_lora_rank):
    per_rank = run_on_ranks(_train_mla, 2, q_lora_rank, timeout=600)
    for index, run in enumerate(RUNS):
        results = [rank_results[index] for rank_results in per_rank]
        names = {n for n, _, _ in results[0]["routing"]}
        # The MLA projections are Muon's: the model really has latent attention.
        assert any("linear_kv_down_proj" in n for n in names), names
        errors = gpt_parity.assert_within_floor(results, results[0]["floor"])
        # Floor-judged (tests/run_comparison.py).
        assert_steps_within_floor(f"MLA {run.strategy}", results[0]["stats"], ("loss",))
        print(f"\nMLA {run.strategy}, q_lora_rank {q_lora_rank}: worst {max(errors.values()):.1e}")


def test_the_core_attention_patch_leaves_standard_attention_alone():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_muon.integrations import local_core_attention

    local_core_attention.patch()
    local_core_attention.patch()  # idempotent
    assert local_core_attention.patched()
    init = DotProductAttention.__init__
    assert getattr(init, "_megatron_muon_mla_channels", False)
    assert getattr(init, "__wrapped__", None) is not None
    assert not getattr(init.__wrapped__, "_megatron_muon_mla_channels", False)

"""QK-clip against a hand-computed per-head scaling on a tiny megatron-core attention layer.

The layer is megatron-core's ``SelfAttention`` (local spec: ``ColumnParallelLinear`` qkv with bias,
``DotProductAttention``), hidden 32, 4 query heads of dim 8, built on CPU inside a gloo rank. Max
logits are recomputed here from the weights (``_hand_max_logits``), independently of the recorder.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from megatron_muon.fsdp.qk_clip import head_clip_factors
from megatron_muon.fsdp.qk_clip_rows import qkv_row_scales
from megatron_muon.testing import run_on_ranks
from tests.fsdp_models import fully_shard_attention

HIDDEN, HEADS, HEAD_DIM, SEQ, BATCH = 32, 4, 8, 6, 4
TAU = 0.6  # the GQA layer's max logits on _inputs() are 0.43..0.68: three heads clip, one not


def _build_attention(num_query_groups: int, seed: int = 0, tp: int = 1):
    """A causal megatron-core SelfAttention on CPU (call inside a rank: needs parallel_state).

    With ``tp > 1`` (world size ``tp``), each rank holds its tensor-parallel partition: its query
    groups' heads and the matching contiguous rows of ``linear_qkv``, cut from the same full
    CPU-initialized weight as with ``tp = 1``.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, 1)
    # Its fork() is a null context: DotProductAttention forks the CUDA RNG tracker for dropout.
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=num_query_groups,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
    )
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec().submodules.self_attention
    attention = build_module(spec, config=config, layer_number=1)
    with torch.no_grad():  # larger weights: logits of order 1 rather than 0.01
        attention.linear_qkv.weight.mul_(4.0)
    return attention


def _inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(seed))
    # Explicit causal mask (True = masked): megatron's default one is allocated on "cuda".
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(diagonal=1).view(1, 1, SEQ, SEQ)
    return x, mask


def _hand_max_logits(weight, bias, x, num_query_groups: int) -> torch.Tensor:
    """Per head: max over batch and causal (i >= j) pairs of q_i . k_j / sqrt(d), by loops."""
    per_group = HEADS // num_query_groups
    rows = (per_group + 2) * HEAD_DIM
    proj = x.double() @ weight.double().T + bias.double()  # [s, b, rows_total]
    result = torch.full((HEADS,), -math.inf, dtype=torch.float64)
    for head in range(HEADS):
        group, within = divmod(head, per_group)
        q = proj[..., group * rows + within * HEAD_DIM :][..., :HEAD_DIM]
        k = proj[..., group * rows + per_group * HEAD_DIM :][..., :HEAD_DIM]
        for i in range(SEQ):
            for j in range(i + 1):
                logits = (q[i] * k[j]).sum(-1) / math.sqrt(HEAD_DIM)  # [b]
                result[head] = max(result[head], logits.max().item())
    return result


def _hand_clipped(weight, max_logits, tau: float, num_query_groups: int) -> torch.Tensor:
    """The expected rows: per group g, q_h *= eta_h / sqrt(eta_g), k *= sqrt(eta_g), v as is."""
    per_group = HEADS // num_query_groups
    rows = (per_group + 2) * HEAD_DIM
    out = weight.clone().double()
    eta = [min(1.0, tau / m) for m in max_logits.tolist()]
    for group in range(num_query_groups):
        eta_g = min(eta[group * per_group : (group + 1) * per_group])
        base = group * rows
        for within in range(per_group):
            start = base + within * HEAD_DIM
            out[start : start + HEAD_DIM] *= eta[group * per_group + within] / math.sqrt(eta_g)
        key = base + per_group * HEAD_DIM
        out[key : key + HEAD_DIM] *= math.sqrt(eta_g)
    return out


def test_row_scales_by_hand_mha_and_gqa() -> None:
    eta = torch.tensor([1.0, 0.25, 0.5, 1.0])
    d = 2
    mha = qkv_row_scales(eta, num_query_groups=4, head_dim=d)
    expected = []
    for e in eta.tolist():  # [q, k, v] per head: sqrt(eta) on q and k
        expected += [math.sqrt(e)] * d + [math.sqrt(e)] * d + [1.0] * d
    torch.testing.assert_close(mha, torch.tensor(expected), atol=1e-7, rtol=0)

    gqa = qkv_row_scales(eta, num_query_groups=2, head_dim=d)
    # group 0: heads (1, 0.25), eta_g = 0.25 -> q: 1/0.5, 0.25/0.5; k: 0.5
    # group 1: heads (0.5, 1), eta_g = 0.5 -> q: 0.5/sqrt(.5), 1/sqrt(.5); k: sqrt(.5)
    r = math.sqrt(0.5)
    expected = [2.0] * d + [0.5] * d + [0.5] * d + [1.0] * d
    expected += [0.5 / r] * d + [1 / r] * d + [r] * d + [1.0] * d
    torch.testing.assert_close(gqa, torch.tensor(expected), atol=1e-7, rtol=0)


def test_row_scales_split_each_heads_factor_by_alpha() -> None:
    """--qk-clip-alpha: queries eta^alpha, keys eta^(1 - alpha) (MHA); with GQA the key takes
    eta_g^(1 - alpha) and each query head the rest of its own eta."""
    eta, d, alpha = torch.tensor([1.0, 0.25, 0.5, 1.0]), 1, 0.3
    mha = qkv_row_scales(eta, num_query_groups=4, head_dim=d, alpha=alpha)
    expected = []
    for e in eta.tolist():
        expected += [e**alpha, e ** (1 - alpha), 1.0]
    torch.testing.assert_close(mha, torch.tensor(expected), atol=1e-7, rtol=0)
    gqa = qkv_row_scales(eta, num_query_groups=2, head_dim=d, alpha=alpha)
    key_0, key_1 = 0.25 ** (1 - alpha), 0.5 ** (1 - alpha)
    expected = [1.0 / key_0, 0.25 / key_0, key_0, 1.0, 0.5 / key_1, 1.0 / key_1, key_1, 1.0]
    torch.testing.assert_close(gqa, torch.tensor(expected), atol=1e-7, rtol=0)


def test_head_clip_factors() -> None:
    factors = head_clip_factors(torch.tensor([50.0, 200.0, -3.0, float("-inf")]), 100.0)
    torch.testing.assert_close(factors, torch.tensor([1.0, 0.5, 1.0, 1.0]))


def _run_single(rank: int, world_size: int, num_query_groups: int) -> dict:
    from megatron_muon.fsdp.qk_clip import QKClip, find_attentions

    attention = _build_attention(num_query_groups)
    assert find_attentions([attention]) == [attention]
    x, mask = _inputs()
    weight = attention.linear_qkv.weight.detach().clone()
    bias = attention.linear_qkv.bias.detach().clone()
    hand = _hand_max_logits(weight, bias, x, num_query_groups)
    tau = float(hand.sort().values[1:3].mean())  # between the 2nd and 3rd largest: some clip
    clip = QKClip([attention], tau)
    attention(x, attention_mask=mask)
    recorded = clip.max_logits()[0].clone()
    stats = clip.clip()
    after = _hand_max_logits(
        attention.linear_qkv.weight.detach(),
        attention.linear_qkv.bias.detach(),
        x,
        num_query_groups,
    )
    attention(x, attention_mask=mask)
    return {
        "hand": hand,
        "recorded": recorded,
        "tau": tau,
        "stats": stats,
        "weight": weight,
        "bias": bias,
        "clipped_weight": attention.linear_qkv.weight.detach().clone(),
        "clipped_bias": attention.linear_qkv.bias.detach().clone(),
        "after_hand": after,
        "after_recorded": clip.max_logits()[0].clone(),
    }


@pytest.mark.multirank
@pytest.mark.parametrize("num_query_groups", [4, 2], ids=["mha", "gqa"])
def test_clip_scales_each_head_by_the_hand_computed_factor(num_query_groups: int) -> None:
    """Recorded max logits = hand-computed; rows scaled as by hand; clipped heads' max = tau."""
    [r] = run_on_ranks(_run_single, 1, num_query_groups)
    torch.testing.assert_close(r["recorded"].double(), r["hand"], atol=1e-5, rtol=1e-5)
    num_above = int((r["hand"] > r["tau"]).sum())
    assert r["stats"].num_clipped_heads == num_above == 2
    assert r["stats"].max_logit == pytest.approx(r["hand"].max().item(), rel=1e-5)
    expected_weight = _hand_clipped(r["weight"], r["hand"], r["tau"], num_query_groups)
    torch.testing.assert_close(r["clipped_weight"].double(), expected_weight, atol=1e-6, rtol=1e-6)
    bias_as_rows = r["bias"].unsqueeze(1)
    expected_bias = _hand_clipped(bias_as_rows, r["hand"], r["tau"], num_query_groups).squeeze(1)
    torch.testing.assert_close(r["clipped_bias"].double(), expected_bias, atol=1e-6, rtol=1e-6)
    # The point of it: each head's logits scaled by exactly eta_h, so clipped heads now peak at tau
    # and the others are unchanged (also GQA heads sharing a key with a clipped head).
    expected_after = r["hand"].clamp(max=r["tau"])
    torch.testing.assert_close(r["after_hand"], expected_after, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r["after_recorded"].double(), expected_after, atol=1e-5, rtol=1e-5)


def _run_sharded(rank: int, world_size: int, splits: list[int], tau: float) -> dict:
    """Rank r forwards batch entries r::world_size; clips its row shard of weight and bias."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from megatron_muon.fsdp.qk_clip import QKClip

    attention = _build_attention(num_query_groups=2)
    x, mask = _inputs()
    mesh = init_device_mesh("cpu", (world_size,))
    start = sum(splits[:rank])

    def shard(full: torch.Tensor) -> torch.nn.Parameter:
        local = full.detach()[start : start + splits[rank]].clone()
        dtensor = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
        return torch.nn.Parameter(dtensor)

    initial = attention.linear_qkv.weight.detach().clone()
    params = [shard(attention.linear_qkv.weight), shard(attention.linear_qkv.bias)]
    group = torch.distributed.group.WORLD if world_size > 1 else None
    clip = QKClip([attention], tau, group=group, params=[params])
    attention(x[:, rank::world_size], attention_mask=mask)
    stats = clip.clip()
    locals_ = [p.to_local().detach().clone() for p in params]
    return {"locals": locals_, "stats": stats, "initial": initial}


@functools.cache
def _unsharded(tau: float) -> dict:
    """The reference: the whole layer and batch in one rank (shared by the sharded tests)."""
    [result] = run_on_ranks(_run_sharded, 1, [64], tau)
    return result


@pytest.mark.multirank
@pytest.mark.parametrize("splits", [[40, 24], [0, 64]], ids=["mid-group", "empty-shard"])
def test_sharded_on_two_ranks_equals_unsharded(splits: list[int]) -> None:
    """Row shards (uneven, cut inside a query group's rows; one empty) clipped on 2 ranks that saw
    different halves of the batch equal the unsharded layer clipped after seeing all of it.

    Tolerance 1e-6: each rank's logits come from a smaller einsum (batch 2 instead of 4), which may
    round differently in the last bit; the max all-reduce itself is exact.
    """
    tau = TAU
    single = _unsharded(tau)
    sharded = run_on_ranks(_run_sharded, 2, splits, tau)
    assert 0 < single["stats"].num_clipped_heads < HEADS
    for rank_result in sharded:  # every rank agrees on the all-reduced max logits
        assert rank_result["stats"].num_clipped_heads == single["stats"].num_clipped_heads
        assert rank_result["stats"].max_logit == pytest.approx(single["stats"].max_logit)
    for index in range(2):  # weight, bias
        mine = torch.cat([sharded[r]["locals"][index] for r in range(2)])
        torch.testing.assert_close(mine, single["locals"][index], atol=1e-6, rtol=1e-6)


def _run_megatron_fsdp(rank: int, world_size: int, strategy: str, tau: float) -> dict:
    """The layer wrapped by Megatron-FSDP; rank r forwards batch entries r::world_size."""
    from megatron.core.transformer.attention import SelfAttention

    from megatron_muon.fsdp.qk_clip import QKClip, find_attentions

    attention = _build_attention(num_query_groups=2)
    wrapped = fully_shard_attention(attention, world_size, strategy, SelfAttention)
    # Built before the first forward, like the optimizer: the modules' params are then the
    # DTensor row shards (the forward swaps in full compute weights).
    clip = QKClip(find_attentions([wrapped]), tau, group=torch.distributed.group.WORLD)
    x, mask = _inputs()
    wrapped(x[:, rank::world_size], mask)
    stats = clip.clip()
    wrapped.install_optimized_model_weights()
    wrapped(x[:, rank::world_size], mask)
    shards = []
    for param in clip.params[0]:
        local = param.to_local().detach().clone()
        row_numel = max(1, local.shape[1:].numel())
        shards.append((param.megatron_fsdp_slice.start // row_numel, local))
    return {"stats": stats, "shards": shards, "after": clip.max_logits()[0]}


@pytest.mark.multirank
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_megatron_fsdp_row_shards_equal_unsharded(strategy: str) -> None:
    """Under real Megatron-FSDP (uneven row shards of qkv weight and bias, located by
    ``megatron_fsdp_slice``), each rank's clipped rows equal the unsharded clip's rows, and after
    the weights are installed the next forward's max logits are at most tau."""
    tau = TAU
    single = _unsharded(tau)
    for rank_result in run_on_ranks(_run_megatron_fsdp, 2, strategy, tau):
        assert rank_result["stats"].num_clipped_heads == single["stats"].num_clipped_heads == 3
        for (start, local), full in zip(rank_result["shards"], single["locals"], strict=True):
            expected = full[start : start + local.shape[0]]
            torch.testing.assert_close(local, expected, atol=1e-6, rtol=1e-6)
        assert float(rank_result["after"].max()) <= tau + 1e-5


def _run_tensor_parallel(rank: int, world_size: int, tau: float) -> dict:
    """TP = world size: rank r holds query group r's heads and rows; the input is replicated."""
    from megatron_muon.fsdp.qk_clip import QKClip

    attention = _build_attention(num_query_groups=2, tp=world_size)
    initial = attention.linear_qkv.weight.detach().clone()
    # No data parallelism: nothing to all-reduce but the reported count over TP.
    clip = QKClip([attention], tau, tp_group=torch.distributed.group.WORLD)
    x, mask = _inputs()
    attention(x, attention_mask=mask)
    stats = clip.clip()
    params = [attention.linear_qkv.weight, attention.linear_qkv.bias]
    return {"initial": initial, "stats": stats, "locals": [p.detach().clone() for p in params]}


@pytest.mark.multirank
def test_tensor_parallel_heads_clip_their_own_rows() -> None:
    """TP = 2 (GQA, one query group per rank): each rank clips its own heads from its own logits;
    its partition equals the matching rows of the TP = 1 clip, and every rank reports the clipped
    heads of both partitions."""
    tau = TAU
    single = _unsharded(tau)
    per_rank = run_on_ranks(_run_tensor_parallel, 2, tau)
    rows = 64 // 2
    for rank, result in enumerate(per_rank):
        mine = slice(rank * rows, (rank + 1) * rows)
        torch.testing.assert_close(result["initial"], single["initial"][mine], atol=0, rtol=0)
        for local, full in zip(result["locals"], single["locals"], strict=True):
            torch.testing.assert_close(local, full[mine], atol=1e-6, rtol=1e-6)
    for result in per_rank:
        assert result["stats"].num_clipped_heads == single["stats"].num_clipped_heads == 3
        assert result["stats"].max_logit == pytest.approx(single["stats"].max_logit, rel=1e-6)


def _run_rejects_qk_layernorm(rank: int, world_size: int) -> str:
    from megatron_muon.fsdp.qk_clip import QKClip

    attention = _build_attention(num_query_groups=2)
    attention.config.qk_layernorm = True
    try:
        QKClip([attention], 1.0)
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.multirank
def test_rejects_layers_with_qk_layernorm_and_bad_threshold() -> None:
    [message] = run_on_ranks(_run_rejects_qk_layernorm, 1)
    assert "QK layernorm" in message
    from megatron_muon.fsdp.qk_clip import QKClip

    with pytest.raises(ValueError, match="threshold"):
        QKClip([], 0.0)
    assert QKClip([], 1.0).clip().num_clipped_heads == 0  # a pipeline stage without attention

"""MuonClip's QK-clip on Multi-Latent Attention: exact per-head factors on the query and kv
up-projections, equal to megatron-core's own MLA ``clip_qk``, on shards, under Megatron-FSDP and
tensor parallelism.

The layer is megatron-core's ``MLASelfAttention`` (local spec, no biases), hidden 32, 4 heads of
query/key 8 + 4 (RoPE), value 8, compressed KV 16, with or without q-LoRA (rank 12), built on CPU
inside a gloo rank. Max logits are recomputed here in float64 from the query and key the core
attention receives (``_logits_from_inputs``), independently of the recorder's per-head loop.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_muon.fsdp.qk_clip_rows import mla_kv_up_row_scales, mla_query_row_scales
from megatron_muon.testing import run_on_ranks
from tests.fsdp_models import fully_shard_attention

pytestmark = pytest.mark.multirank

HIDDEN, HEADS, NOPE, ROPE, VALUE, KV_LORA, Q_LORA = 32, 4, 8, 4, 8, 16, 12
SEQ, BATCH = 6, 4
ALPHA = 0.3  # not Megatron's 0.5: shows the query/key split follows --qk-clip-alpha
Q_ROWS, KV_ROWS = HEADS * (NOPE + ROPE), HEADS * (NOPE + VALUE)


def _build_mla(q_lora_rank: int | None, tp: int = 1):
    """A causal ``MLASelfAttention`` on CPU (inside a rank); with ``tp > 1`` each rank holds its
    heads' rows, cut from the same CPU-initialized full weights as with ``tp = 1``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_muon.integrations import local_core_attention

    local_core_attention.patch()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, 1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    config = MLATransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_LORA,
        qk_head_dim=NOPE,
        qk_pos_emb_head_dim=ROPE,
        v_head_dim=VALUE,
        rope_type="rope",
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        qk_clip_alpha=ALPHA,
    )
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True).submodules.self_attention
    attention = build_module(spec, config=config, layer_number=1)
    with torch.no_grad():  # larger weights: logits of order 1 rather than 0.01
        _query_linear(attention).weight.mul_(4.0)
        attention.linear_kv_up_proj.weight.mul_(4.0)
    return attention


def _query_linear(attention) -> torch.nn.Module:
    return getattr(attention, "linear_q_up_proj", None) or attention.linear_q_proj


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(diagonal=1).view(1, 1, SEQ, SEQ)
    return x, mask


def _weights(attention) -> dict[str, torch.Tensor]:
    named = dict(attention.named_parameters())
    return {name: p.detach().clone() for name, p in named.items()}


def _logits_from_inputs(attention, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per head: the float64 max over batch and causal pairs of ``softmax_scale * q . k``, from
    the query and key a forward hands the core attention ``[s, b, heads, 12]``."""
    captured = {}

    def capture(module, args, kwargs):
        captured["query"], captured["key"] = args[0], args[1]

    handle = attention.core_attention.register_forward_pre_hook(capture, with_kwargs=True)
    with torch.no_grad():
        attention(x, attention_mask=mask)
    handle.remove()
    query, key = captured["query"].double(), captured["key"].double()
    logits = torch.einsum("qbhd,kbhd->bhqk", query, key) * attention.softmax_scale
    return logits.masked_fill(mask, float("-inf")).amax(dim=(0, 2, 3))


def _clip_once(rank: int, world_size: int, q_lora_rank: int | None) -> dict:
    """One forward, a clip with tau between the 2nd and 3rd largest max logit, a re-forward; and
    megatron-core's ``clip_qk`` on a second copy of the layer from the same max logits."""
    from megatron_muon.fsdp.qk_clip import QKClip, find_attentions

    attention = _build_mla(q_lora_rank)
    assert find_attentions([attention]) == [attention]
    x, mask = _inputs()
    initial = _weights(attention)
    hand = _logits_from_inputs(attention, x, mask)
    tau = float(hand.sort().values[1:3].mean())
    clip = QKClip([attention], tau, alpha=ALPHA)
    attention(x, attention_mask=mask)
    recorded = clip.max_logits()[0].clone()
    stats = clip.clip()
    clipped = _weights(attention)
    after = _logits_from_inputs(attention, x, mask)

    mcore = _megatron_core_clip(q_lora_rank, tau, recorded)
    return {
        "tau": tau,
        "hand": hand,
        "recorded": recorded,
        "stats": stats,
        "initial": initial,
        "clipped": clipped,
        "after": after,
        "mcore": _weights(mcore),
    }


def _megatron_core_clip(q_lora_rank: int | None, tau: float, max_logits: torch.Tensor):
    """A fresh copy of the layer (the same initial weights) clipped by megatron-core's own MLA
    ``clip_qk`` from ``max_logits`` (it reads them from the core attention, as TE records them)."""
    mcore = _build_mla(q_lora_rank)
    mcore.config.qk_clip, mcore.config.qk_clip_threshold = True, tau
    mcore.core_attention.current_max_attn_logits = max_logits.clone()
    mcore.clip_qk()
    return mcore


def _query_name(q_lora_rank: int | None) -> str:
    return "linear_q_proj.weight" if q_lora_rank is None else "linear_q_up_proj.weight"


def _per_head_rows(weight: torch.Tensor, first: int, second: int):
    """``(H, first + second, cols)`` rows of a per-head ``[first | second]`` matrix, split."""
    rows = weight.view(HEADS, first + second, -1)
    return rows[:, :first], rows[:, first:]


@pytest.mark.parametrize("q_lora_rank", [None, Q_LORA], ids=["no-q-lora", "q-lora"])
def test_mla_clip_scales_q_nope_q_pe_and_k_nope_by_eta_powers(q_lora_rank) -> None:
    [r] = run_on_ranks(_clip_once, 1, q_lora_rank)
    tau, hand = r["tau"], r["hand"]
    torch.testing.assert_close(r["recorded"].double(), hand, atol=0, rtol=1e-5)
    eta = torch.where(hand > tau, tau / hand, torch.ones_like(hand))
    is_clipped = hand > tau
    assert r["stats"].num_clipped_heads == int(is_clipped.sum()) == 2
    # Re-forward: clipped heads peak at tau, the others are unchanged.
    torch.testing.assert_close(
        r["after"][is_clipped], torch.full((2,), tau).double(), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(r["after"][~is_clipped], hand[~is_clipped], rtol=1e-5, atol=0)
    # Rows: q_nope x eta^alpha, q_pe x eta, k_nope x eta^(1 - alpha); fp32 products of the
    # initial rows with the fp64 factor, one rounding each.
    query = _query_name(q_lora_rank)
    q_nope, q_pe = _per_head_rows(r["clipped"][query], NOPE, ROPE)
    q_nope0, q_pe0 = _per_head_rows(r["initial"][query], NOPE, ROPE)
    k_nope, v = _per_head_rows(r["clipped"]["linear_kv_up_proj.weight"], NOPE, VALUE)
    k_nope0, v0 = _per_head_rows(r["initial"]["linear_kv_up_proj.weight"], NOPE, VALUE)
    per_head = eta.view(HEADS, 1, 1)
    for got, before, factor in [
        (q_nope, q_nope0, per_head**ALPHA),
        (q_pe, q_pe0, per_head),
        (k_nope, k_nope0, per_head ** (1 - ALPHA)),
    ]:
        torch.testing.assert_close(got.double(), before.double() * factor, rtol=3e-7, atol=0)
    # Value rows, the shared rotary key (kv down-projection) and everything else: bitwise.
    assert torch.equal(v, v0)
    for name, before in r["initial"].items():
        if name not in (query, "linear_kv_up_proj.weight"):
            assert torch.equal(r["clipped"][name], before), name
    # megatron-core's own MLA clip_qk, given the same max logits (all positive here).
    assert bool((r["recorded"] > 0).all())
    for name, theirs in r["mcore"].items():
        torch.testing.assert_close(r["clipped"][name], theirs, atol=1e-7, rtol=0, msg=name)


def _negative_max_logits(rank: int, world_size: int) -> dict:
    """Max logits ``[-2, 0, 2 tau, -inf]`` (-inf: a head that saw no token) through our clip and
    megatron-core's."""
    from megatron_muon.fsdp.qk_clip import QKClip

    tau = 0.5
    maxima = torch.tensor([-2.0, 0.0, 2 * tau, float("-inf")])
    attention = _build_mla(None)
    initial = _weights(attention)
    clip = QKClip([attention], tau, alpha=ALPHA)
    x, mask = _inputs()
    attention(x, attention_mask=mask)
    clip.max_logits()[0].copy_(maxima)
    stats = clip.clip()
    mcore = _megatron_core_clip(None, tau, maxima)
    return {
        "stats": stats,
        "initial": initial,
        "clipped": _weights(attention),
        "mcore": _weights(mcore),
    }


def test_negative_and_missing_max_logits_leave_their_heads_untouched() -> None:
    [r] = run_on_ranks(_negative_max_logits, 1)
    assert r["stats"].num_clipped_heads == 1
    for name in ("linear_q_proj.weight", "linear_kv_up_proj.weight"):
        mine, before = r["clipped"][name], r["initial"][name]
        assert torch.isfinite(mine).all(), name
        rows_per_head = mine.shape[0] // HEADS
        for head in (0, 1, 3):
            rows = slice(head * rows_per_head, (head + 1) * rows_per_head)
            assert torch.equal(mine[rows], before[rows]), (name, head)
        assert not torch.equal(mine, before), name  # head 2 was scaled
    # megatron-core's clamp(tau / max, max=1) is negative for the negative max: NaN rows.
    assert torch.isnan(r["mcore"]["linear_q_proj.weight"]).any()


def _refusals(rank: int, world_size: int) -> list[str]:
    from megatron_muon.fsdp.qk_clip import QKClip

    messages = []
    for setting in ("dsa", "cache_mla_latents"):
        attention = _build_mla(Q_LORA)
        if setting == "dsa":
            attention.config.experimental_attention_variant = "dsa"
        else:
            attention.cache_mla_latents = True
        try:
            QKClip([attention], 1.0)
            messages.append("")
        except ValueError as error:
            messages.append(str(error))
    for alpha in (0.0, 1.0):
        try:
            QKClip([], 1.0, alpha=alpha)
            messages.append("")
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_what_cannot_be_clipped_exactly_is_refused_by_name() -> None:
    [messages] = run_on_ranks(_refusals, 1)
    dsa, cached, alpha_0, alpha_1 = messages
    assert "experimental_attention_variant='dsa'" in dsa
    assert "cache_mla_latents" in cached
    assert "alpha must be in (0, 1), got 0.0" in alpha_0 and "got 1.0" in alpha_1


# --------------------------------------------------------------------------------------------------
# row shards, Megatron-FSDP, tensor parallelism: each equal to the unsharded clip
# --------------------------------------------------------------------------------------------------


def _q_lora_max_logits(rank: int, world_size: int) -> torch.Tensor:
    attention = _build_mla(Q_LORA)
    return _logits_from_inputs(attention, *_inputs())


@functools.cache
def _tau() -> float:
    """Between the q-LoRA layer's 2nd and 3rd largest max logit on ``_inputs()``: 2 heads clip."""
    [hand] = run_on_ranks(_q_lora_max_logits, 1)
    return float(hand.sort().values[1:3].mean())


def _run_sharded(rank: int, world_size: int, tau: float, splits: dict[str, list[int]]) -> dict:
    """Rank r forwards batch entries r::world_size; clips its Shard(0) rows of the query and kv
    up-projections (``splits``: rows per rank of each)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from megatron_muon.fsdp.qk_clip import QKClip

    attention = _build_mla(Q_LORA)
    x, mask = _inputs()
    mesh = init_device_mesh("cpu", (world_size,))

    def shard(full: torch.Tensor, rows: list[int]) -> torch.nn.Parameter:
        start = sum(rows[:rank])
        local = full.detach()[start : start + rows[rank]].clone()
        dtensor = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
        return torch.nn.Parameter(dtensor)

    params = [
        shard(attention.linear_q_up_proj.weight, splits["q"]),
        shard(attention.linear_kv_up_proj.weight, splits["kv"]),
    ]
    group = torch.distributed.group.WORLD if world_size > 1 else None
    clip = QKClip([attention], tau, group=group, params=[params], alpha=ALPHA)
    attention(x[:, rank::world_size], attention_mask=mask)
    stats = clip.clip()
    return {"stats": stats, "locals": [p.to_local().detach().clone() for p in params]}


@functools.cache
def _unsharded() -> dict:
    [result] = run_on_ranks(_run_sharded, 1, _tau(), {"q": [Q_ROWS], "kv": [KV_ROWS]})
    return result


@pytest.mark.parametrize(
    "splits",
    [{"q": [30, 18], "kv": [40, 24]}, {"q": [0, Q_ROWS], "kv": [KV_ROWS, 0]}],
    ids=["inside-heads", "empty-shard"],
)
def test_row_shards_on_two_ranks_equal_the_unsharded_clip(splits) -> None:
    """Uneven row shards cut inside heads (or empty), on 2 ranks that saw different halves of the
    batch, equal the unsharded layer clipped after seeing all of it (1e-6: each rank's logits come
    from a smaller einsum that may round differently; the max all-reduce is exact)."""
    single = _unsharded()
    assert single["stats"].num_clipped_heads == 2
    sharded = run_on_ranks(_run_sharded, 2, _tau(), splits)
    for result in sharded:
        assert result["stats"].num_clipped_heads == single["stats"].num_clipped_heads
    for index in range(2):
        mine = torch.cat([sharded[rank]["locals"][index] for rank in range(2)])
        torch.testing.assert_close(mine, single["locals"][index], atol=1e-6, rtol=1e-6)


def _run_megatron_fsdp(rank: int, world_size: int, tau: float, strategy: str) -> dict:
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_muon.fsdp.qk_clip import QKClip, find_attentions

    attention = _build_mla(Q_LORA)
    wrapped = fully_shard_attention(attention, world_size, strategy, MLASelfAttention)
    # Built before the first forward, like the optimizer: the params are the DTensor row shards.
    clip = QKClip(find_attentions([wrapped]), tau, group=torch.distributed.group.WORLD, alpha=ALPHA)
    x, mask = _inputs()
    wrapped(x[:, rank::world_size], mask)
    stats = clip.clip()
    shards = []
    for param in clip.params[0]:
        local = param.to_local().detach().clone()
        shards.append((param.megatron_fsdp_slice.start // local.shape[1], local))
    return {"stats": stats, "shards": shards}


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_megatron_fsdp_row_shards_equal_the_unsharded_clip(strategy: str) -> None:
    single = _unsharded()
    for result in run_on_ranks(_run_megatron_fsdp, 2, _tau(), strategy):
        assert result["stats"].num_clipped_heads == single["stats"].num_clipped_heads
        for (start, local), full in zip(result["shards"], single["locals"], strict=True):
            expected = full[start : start + local.shape[0]]
            torch.testing.assert_close(local, expected, atol=1e-6, rtol=1e-6)


def _run_tensor_parallel(rank: int, world_size: int, tau: float) -> dict:
    """TP = world size: rank r holds heads 2r, 2r+1 and their rows; the input is replicated."""
    from megatron_muon.fsdp.qk_clip import QKClip

    attention = _build_mla(Q_LORA, tp=world_size)
    clip = QKClip([attention], tau, alpha=ALPHA, tp_group=torch.distributed.group.WORLD)
    x, mask = _inputs()
    attention(x, attention_mask=mask)
    stats = clip.clip()
    params = [attention.linear_q_up_proj.weight, attention.linear_kv_up_proj.weight]
    return {"stats": stats, "locals": [p.detach().clone() for p in params]}


def test_tensor_parallel_partitions_equal_their_heads_of_the_tp1_clip() -> None:
    """TP = 2: each partition's rows equal its heads' rows of the TP = 1 clip; every TP rank
    reports the clipped heads of both partitions."""
    single = _unsharded()
    for rank, result in enumerate(run_on_ranks(_run_tensor_parallel, 2, _tau())):
        assert result["stats"].num_clipped_heads == single["stats"].num_clipped_heads
        for local, full in zip(result["locals"], single["locals"], strict=True):
            mine = full.view(2, -1, full.shape[1])[rank]
            torch.testing.assert_close(local, mine, atol=1e-6, rtol=1e-6)


def test_mla_row_scales_by_hand() -> None:
    eta = torch.tensor([1.0, 0.25])
    query = mla_query_row_scales(eta, qk_head_dim=2, qk_pos_emb_head_dim=1, alpha=0.5)
    torch.testing.assert_close(query, torch.tensor([1.0, 1, 1, 0.5, 0.5, 0.25]))
    kv = mla_kv_up_row_scales(eta, qk_head_dim=1, v_head_dim=2, alpha=0.5)
    torch.testing.assert_close(kv, torch.tensor([1.0, 1, 1, 0.5, 1, 1]))

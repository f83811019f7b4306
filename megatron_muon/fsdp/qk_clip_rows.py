"""Which weight rows carry each attention head's queries and keys, and QK-clip's scale for each row.

QK-clip (``megatron_muon.fsdp.qk_clip``) multiplies head ``h``'s pre-softmax logits by
``eta_h <= 1``, split between the query side (``eta^alpha``) and the key side
(``eta^(1 - alpha)``); ``alpha`` is Megatron's ``--qk-clip-alpha`` (default 0.5). This module
knows, per megatron-core attention kind, the (tensor-parallel-local) matrices whose rows to scale:

- ``SelfAttention`` (MHA, GQA): ``linear_qkv`` (weight and bias), rows interleaved per query
  group ``[q heads of group 0 (G * d rows), k of group 0 (d), v of group 0 (d), group 1, ...]``.
  ``G`` query heads sharing one key get the key scale ``eta_g^(1 - alpha)`` of the group's
  smallest ``eta_g`` and each query head ``eta_h / eta_g^(1 - alpha)``: every head's logits are
  scaled by exactly its own ``eta_h`` (megatron-core's ``SelfAttention.clip_qk`` scales every head
  of a group by ``eta_g``); a group of one is ``eta^alpha`` / ``eta^(1 - alpha)``.
- ``MultiLatentAttention`` (MLA; DeepSeek-V3, Kimi K2): the query up-projection
  (``linear_q_up_proj`` with q-LoRA, else ``linear_q_proj``), per head
  ``[qk_head_dim q_nope rows | qk_pos_emb_head_dim q_pe rows]``, scaled ``eta^alpha`` and
  ``eta``; ``linear_kv_up_proj``, per head ``[qk_head_dim k_nope | v_head_dim v]``, scaled
  ``eta^(1 - alpha)`` and 1. The rotary key ``k_pe`` (the last rows of ``linear_kv_down_proj``)
  is shared by all heads and left alone, so ``q_nope . k_nope`` and ``q_pe . k_pe`` are both
  scaled by ``eta``. The norms on the compressed latents sit before the up-projections, so they do
  not undo the scaling. As megatron-core's MLA ``clip_qk``, which this matches on unsharded
  weights, except that a head whose max logit is not above ``tau`` (negative ones included) is
  left alone rather than turned into NaN rows.

Under tensor parallelism every partition holds whole heads (and whole query groups), so the rows
and scales here are TP-local. The softmax scale is the one the core attention applies: MLA's
(YaRN ``mscale^2 / sqrt(q_head_dim)``), else ``config.softmax_scale`` or ``1 / sqrt(d)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.attention import Attention, SelfAttention
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

__all__ = [
    "DEFAULT_ALPHA",
    "HeadRows",
    "check_clippable",
    "find_attentions",
    "head_rows",
    "mla_kv_up_row_scales",
    "mla_query_row_scales",
    "qkv_row_scales",
    "softmax_scale",
]

# The query side's share of a head's factor: megatron-core's TransformerConfig.qk_clip_alpha and
# Megatron-LM's --qk-clip-alpha default.
DEFAULT_ALPHA = 0.5


@dataclass(frozen=True, slots=True)
class HeadRows:
    """A tensor whose dim-0 rows (TP-local) hold heads' query or key projections.

    Attributes:
        name: the module and tensor, for messages (``"linear_qkv.weight"``).
        param: the module's tensor (weight or bias).
        num_rows: rows per tensor-parallel partition.
        row_scales: per-head ``eta`` ``(heads per partition,)`` -> ``(num_rows,)`` fp32 scales.
    """

    name: str
    param: torch.Tensor
    num_rows: int
    row_scales: Callable[[torch.Tensor], torch.Tensor]


def qkv_row_scales(
    eta: torch.Tensor, num_query_groups: int, head_dim: int, alpha: float = DEFAULT_ALPHA
) -> torch.Tensor:
    """Per-row scale of a (TP-local) ``linear_qkv`` weight for per-head logit factors ``eta``.

    Args:
        eta: ``(H,)`` logit factor of each query head, in ``(0, 1]``; heads ordered by group.
        num_query_groups: ``G`` key/value heads (``H % G == 0``).
        head_dim: ``d`` rows per head.
        alpha: the query side's share of the factor (``--qk-clip-alpha``).

    Returns:
        ``(G * (H / G + 2) * d,)`` fp32: per group, ``eta_h / eta_g^(1 - alpha)`` for each query
        head's ``d`` rows, ``eta_g^(1 - alpha)`` for the key rows and 1 for the value rows, where
        ``eta_g`` is the group's smallest ``eta``.
    """
    num_heads = eta.numel()
    if num_heads % num_query_groups:
        raise ValueError(f"{num_heads} heads do not split into {num_query_groups} query groups")
    eta = eta.float().view(num_query_groups, num_heads // num_query_groups)
    key_scale = eta.min(dim=1, keepdim=True).values.pow(1 - alpha)  # (G, 1)
    query = (eta / key_scale).repeat_interleave(head_dim, dim=1)  # (G, H/G * d)
    key = key_scale.expand(-1, head_dim)
    value = torch.ones_like(key)
    return torch.cat([query, key, value], dim=1).reshape(-1)


def mla_query_row_scales(
    eta: torch.Tensor, qk_head_dim: int, qk_pos_emb_head_dim: int, alpha: float = DEFAULT_ALPHA
) -> torch.Tensor:
    """Per-row scale of MLA's query up-projection: ``(H * (qk_head_dim + qk_pos_emb_head_dim),)``
    fp32, per head ``eta^alpha`` on the ``q_nope`` rows and ``eta`` on the ``q_pe`` rows."""
    eta = eta.float()
    return _per_head(eta, [(eta.pow(alpha), qk_head_dim), (eta, qk_pos_emb_head_dim)])


def mla_kv_up_row_scales(
    eta: torch.Tensor, qk_head_dim: int, v_head_dim: int, alpha: float = DEFAULT_ALPHA
) -> torch.Tensor:
    """Per-row scale of MLA's ``linear_kv_up_proj``: ``(H * (qk_head_dim + v_head_dim),)`` fp32,
    per head ``eta^(1 - alpha)`` on the ``k_nope`` rows and 1 on the value rows."""
    key = eta.float().pow(1 - alpha)
    return _per_head(eta, [(key, qk_head_dim), (torch.ones_like(key), v_head_dim)])


def _per_head(eta: torch.Tensor, blocks: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Per head, each ``(per-head scale (H,), rows)`` block repeated over its rows, concatenated."""
    num_heads = eta.numel()
    columns = [scale.view(num_heads, 1).expand(-1, rows) for scale, rows in blocks]
    return torch.cat(columns, dim=1).reshape(-1)


def find_attentions(modules: Iterable[torch.nn.Module]) -> list[Attention]:
    """Every megatron-core ``SelfAttention`` and ``MultiLatentAttention`` inside ``modules`` (model
    chunks), in module order."""
    kinds = (SelfAttention, MultiLatentAttention)
    return [m for module in modules for m in module.modules() if isinstance(m, kinds)]


def head_rows(attention: Attention, alpha: float = DEFAULT_ALPHA) -> list[HeadRows]:
    """The tensors QK-clip scales in ``attention`` (see the module docstring), weights first."""
    heads = attention.num_attention_heads_per_partition
    if isinstance(attention, MultiLatentAttention):
        config: Any = attention.config  # MLATransformerConfig
        nope, rope, value = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        query_name = "linear_q_proj" if config.q_lora_rank is None else "linear_q_up_proj"
        return [
            *_linear_rows(
                attention,
                query_name,
                heads * (nope + rope),
                lambda eta: mla_query_row_scales(eta, nope, rope, alpha),
            ),
            *_linear_rows(
                attention,
                "linear_kv_up_proj",
                heads * (nope + value),
                lambda eta: mla_kv_up_row_scales(eta, nope, value, alpha),
            ),
        ]
    groups = attention.num_query_groups_per_partition
    head_dim = attention.hidden_size_per_attention_head
    return _linear_rows(
        attention,
        "linear_qkv",
        groups * (heads // groups + 2) * head_dim,
        lambda eta: qkv_row_scales(eta, groups, head_dim, alpha),
    )


def _linear_rows(
    attention: Attention,
    name: str,
    num_rows: int,
    row_scales: Callable[[torch.Tensor], torch.Tensor],
) -> list[HeadRows]:
    """A linear layer's weight, and its bias if it has one, with the same rows and scales."""
    linear = getattr(attention, name)
    rows = [HeadRows(f"{name}.weight", linear.weight, num_rows, row_scales)]
    bias = getattr(linear, "bias", None)
    if isinstance(bias, torch.Tensor) and bias.numel() > 0:
        rows.append(HeadRows(f"{name}.bias", bias, num_rows, row_scales))
    return rows


def check_clippable(attention: Attention, index: int) -> None:
    """Raises ``ValueError`` naming why scaling weight rows cannot clip ``attention``'s logits."""
    config: Any = attention.config
    if isinstance(attention, MultiLatentAttention):
        variant = getattr(config, "experimental_attention_variant", None)
        if variant is not None:
            raise ValueError(
                f"attention {index}: QK-clip does not support MLA with "
                f"experimental_attention_variant={variant!r} (DSA's indexer scores tokens with "
                "its own projections, which the clip does not scale)"
            )
        if getattr(attention, "cache_mla_latents", False) or not hasattr(
            attention, "linear_kv_up_proj"
        ):
            raise ValueError(
                f"attention {index}: QK-clip does not support MLA with cache_mla_latents (the "
                "absorbed key up-projection is not a weight the clip can scale)"
            )
        return
    if not isinstance(attention, SelfAttention):
        raise ValueError(
            f"attention {index} is a {type(attention).__name__}, not SelfAttention or "
            "MultiLatentAttention"
        )
    if config.qk_layernorm or config.qk_l2_norm:
        raise ValueError(
            f"attention {index}: QK layernorm normalizes q and k, so scaling their weights does "
            "not change the logits; QK-clip is for layers without it"
        )
    if config.attention_output_gate:
        raise ValueError(f"attention {index}: gated attention's qkv row layout is not supported")
    if config.num_query_groups < attention.world_size:
        raise ValueError(
            f"attention {index}: fewer query groups ({config.num_query_groups}) than tensor "
            f"parallel ranks ({attention.world_size}) replicate key/value rows across TP ranks; "
            "not supported"
        )


def softmax_scale(attention: Attention) -> float:
    """The factor between ``q . k`` and the logit the softmax sees (query-key layer scaling's
    division by the layer number is undone inside the softmax, so it does not count)."""
    if isinstance(attention, MultiLatentAttention):
        return float(attention.softmax_scale)
    scale = attention.config.softmax_scale
    return scale if scale is not None else 1.0 / math.sqrt(attention.hidden_size_per_attention_head)

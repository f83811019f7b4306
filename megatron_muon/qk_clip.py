"""QK-clip (MuonClip, Kimi K2): bound each attention head's pre-softmax logits after a step.

After each optimizer step, for every attention head ``h`` whose largest pre-softmax logit
``max_h = max softmax_scale * q_h . k`` seen in the forward passes since the last clip exceeds the
threshold ``tau``, the query and key weight rows of the head are scaled so that its logits are
multiplied by ``eta_h = tau / max_h`` (``eta_h = 1`` for the other heads):

- MHA: the query rows and the key rows of head ``h`` are each scaled by ``sqrt(eta_h)``.
- GQA (``G`` query heads share one key head): the shared key rows are scaled by ``sqrt(eta_g)``,
  ``eta_g = min`` of ``eta`` over the group, and each query head's rows by ``eta_h / sqrt(eta_g)``,
  so that every head's logits are scaled by exactly its own ``eta_h`` (a group of one is MHA).
  megatron-core's own ``SelfAttention.clip_qk`` instead scales every head of a group by ``eta_g``.

Value rows are untouched; a ``linear_qkv`` bias is scaled with its weight rows (the logits are
bilinear in the full projections, bias included).

Where the max logits come from: with TE's fused attention (TE >= 2.9, ``return_max_logit``) the core
attention records ``current_max_attn_logits`` itself and that is read; otherwise a forward hook on
``core_attention`` recomputes the scaled ``q k^T`` per head (masked entries excluded; causal masks
from ``attn_mask_type`` as well as explicit ``attention_mask``s) and keeps the running max. Packed
(THD) sequences are TE-only. QK-clip cannot act through QK layernorm, so it refuses such layers.

Sharding. ``linear_qkv``'s (tensor-parallel-local) rows are interleaved per query group:
``[q heads of group 0 (G * d rows), k of group 0 (d), v of group 0 (d), q heads of group 1, ...]``.
Under tensor parallelism each TP rank holds whole query groups and their heads, so everything above
is TP-local and needs no TP communication. Under Megatron-FSDP each data-parallel rank holds a
contiguous row range ``[start, stop)`` of that matrix (``megatron_muon.layout``) and scales only its
own rows with the matching slice of the per-row scales. The max logits are all-reduced (MAX) over
the data-parallel group first, since its ranks saw different tokens and must agree on ``eta``.

Call ``QKClip.clip()`` after ``optimizer.step()`` on the params the optimizer updated (under
Megatron-FSDP: before the updated weights are installed into the compute buffers). Under
Megatron-FSDP, build ``QKClip`` when the optimizer is built, before the first forward: the default
``params`` are read from the modules then, while they are the DTensor row shards the optimizer
updates (a forward swaps in the unsharded compute weights, which the next install overwrites); or
pass the optimizer's params explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_muon.layout import gather_row_layouts, local_tensor

__all__ = [
    "QKClip",
    "QKClipStats",
    "find_self_attentions",
    "head_clip_factors",
    "qkv_row_scales",
    "scale_local_rows_",
]


def head_clip_factors(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """``eta_h = tau / max_h`` where ``max_h > tau``, else 1. ``(H,)`` in, ``(H,)`` fp32 out."""
    max_logits = max_logits.float()
    clipped = max_logits > threshold
    return torch.where(clipped, threshold / max_logits.clamp_min(threshold), 1.0)


def qkv_row_scales(eta: torch.Tensor, num_query_groups: int, head_dim: int) -> torch.Tensor:
    """Per-row scale of a (TP-local) ``linear_qkv`` weight for per-head logit factors ``eta``.

    Args:
        eta: ``(H,)`` logit factor of each query head, in ``(0, 1]``; heads ordered by group.
        num_query_groups: ``G`` key/value heads (``H % G == 0``).
        head_dim: ``d`` rows per head.

    Returns:
        ``(G * (H / G + 2) * d,)`` fp32: per group, ``eta_h / sqrt(eta_g)`` for each query head's
        ``d`` rows, ``sqrt(eta_g)`` for the key rows and 1 for the value rows, where ``eta_g`` is
        the group's smallest ``eta``.
    """
    num_heads = eta.numel()
    if num_heads % num_query_groups:
        raise ValueError(f"{num_heads} heads do not split into {num_query_groups} query groups")
    eta = eta.float().view(num_query_groups, num_heads // num_query_groups)
    key_scale = eta.min(dim=1, keepdim=True).values.sqrt()  # (G, 1)
    query = (eta / key_scale).repeat_interleave(head_dim, dim=1)  # (G, H/G * d)
    key = key_scale.expand(-1, head_dim)
    value = torch.ones_like(key)
    return torch.cat([query, key, value], dim=1).reshape(-1)


def scale_local_rows_(local_rows: torch.Tensor, row_scales: torch.Tensor, start: int) -> None:
    """Scales a rank's rows ``[start, start + n)`` of a matrix in place by their row scales.

    Args:
        local_rows: ``(n, ...)`` this rank's contiguous rows (weight ``(n, cols)`` or bias
            ``(n,)``), any float dtype; ``n`` may be 0.
        row_scales: ``(num_rows,)`` scales of all rows of the full matrix.
        start: index of ``local_rows[0]`` in the full matrix.
    """
    num_rows = local_rows.shape[0]
    if num_rows == 0:
        return
    scales = row_scales[start : start + num_rows].to(local_rows.device, local_rows.dtype)
    local_rows.mul_(scales.view(num_rows, *([1] * (local_rows.ndim - 1))))


def find_self_attentions(modules: Iterable[torch.nn.Module]) -> list[SelfAttention]:
    """Every megatron-core ``SelfAttention`` inside ``modules`` (model chunks), in module order."""
    return [m for module in modules for m in module.modules() if isinstance(m, SelfAttention)]


@dataclass(frozen=True, slots=True)
class QKClipStats:
    """One clip: heads clipped (TP-local heads of all layers) and the largest max logit seen."""

    num_clipped_heads: int
    max_logit: float


class _MaxLogitHook:
    """Forward hook on a core attention: running per-head max of the scaled ``q k^T`` logits."""

    def __init__(self, softmax_scale: float) -> None:
        self.softmax_scale = softmax_scale
        self.max_logits: torch.Tensor | None = None  # (heads per partition,) fp32

    def __call__(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        names = ("query", "key", "value", "attention_mask")
        inputs = dict(zip(names, args, strict=False)) | kwargs
        if inputs.get("packed_seq_params") is not None:
            raise ValueError("QK-clip's logit recorder does not support packed sequences (use TE)")
        query, key = inputs["query"], inputs["key"]  # [sq, b, np, hn], [sk, b, ng, hn]
        mask = inputs.get("attention_mask")  # bool, True = masked, broadcastable to [b, np, sq, sk]
        mask_type = inputs.get("attn_mask_type") or getattr(module, "attn_mask_type", None)
        seq_q, batch, num_heads, _ = query.shape
        seq_k, heads_per_key = key.size(0), num_heads // key.size(2)
        causal = mask_type == AttnMaskType.causal and seq_q == seq_k
        future = torch.ones(seq_q, seq_k, dtype=torch.bool, device=query.device).triu(diagonal=1)
        per_head = []
        with torch.no_grad():
            # One head at a time: a [b, sq, sk] fp32 block, not all heads' scores at once.
            for head in range(num_heads):
                q, k = query[:, :, head].float(), key[:, :, head // heads_per_key].float()
                logits = torch.einsum("qbd,kbd->bqk", q, k) * self.softmax_scale
                if mask is not None:
                    head_mask = mask.bool().expand(batch, num_heads, seq_q, seq_k)[:, head]
                    logits = logits.masked_fill(head_mask, float("-inf"))
                if causal:
                    logits = logits.masked_fill(future, float("-inf"))
                per_head.append(logits.amax())
        batch_max = torch.stack(per_head)
        if self.max_logits is None:
            self.max_logits = batch_max
        else:
            self.max_logits = torch.maximum(self.max_logits, batch_max)


class QKClip:
    """MuonClip's QK-clip over megatron-core self-attention layers (see the module docstring).

    Args:
        attentions: the ``SelfAttention`` layers to clip (``find_self_attentions(model)``).
        threshold: ``tau`` > 0, in units of pre-softmax logits (``--qk-clip-threshold``).
        group: data-parallel group (``dp_cp``) whose ranks see different tokens and over which
            the weights' rows are sharded; ``None`` when not distributed.
        params: per attention, the tensors whose rows to scale, each with ``linear_qkv``'s rows
            (dim 0): default ``[linear_qkv.weight]`` plus ``linear_qkv.bias`` if any. Plain
            tensors or Megatron-FSDP ``Shard(0)`` DTensors.

    Collective over ``group`` at construction (row layouts) and in ``clip()`` (one all-reduce).
    """

    def __init__(
        self,
        attentions: Sequence[SelfAttention],
        threshold: float,
        group: dist.ProcessGroup | None = None,
        params: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> None:
        if not threshold > 0:
            raise ValueError(f"QK-clip threshold must be positive, got {threshold}")
        if params is not None and len(params) != len(attentions):
            raise ValueError(f"{len(params)} param lists for {len(attentions)} attention layers")
        self.attentions = list(attentions)
        self.threshold = float(threshold)
        self.group = group
        self.params: list[list[torch.Tensor]] = (
            [list(p) for p in params]
            if params is not None
            else [_default_params(attention) for attention in self.attentions]
        )
        for index, attention in enumerate(self.attentions):
            _check_supported(attention, index)
        flat = [tensor for tensors in self.params for tensor in tensors]
        # Rows of each param's TP-local matrix: under tensor parallelism a Megatron-FSDP DTensor
        # has the global shape of the unsplit weight.
        layouts = iter(gather_row_layouts(flat, group) if flat else [])
        layouts_of = [[next(layouts) for _ in tensors] for tensors in self.params]
        for index, attention in enumerate(self.attentions):
            rows = _qkv_rows_per_partition(attention)
            for tensor, layout in zip(self.params[index], layouts_of[index], strict=True):
                if layout.num_rows != rows:
                    raise ValueError(
                        f"attention {index}: a QK-clip param of shape {tuple(tensor.shape)} "
                        f"({layout.num_rows} rows per TP partition) does not have the {rows} "
                        "rows of this TP rank's linear_qkv"
                    )
        rank = dist.get_rank(group) if group is not None else 0
        self._row_starts = [[layout.ranges[rank][0] for layout in of] for of in layouts_of]
        self._hooks: list[_MaxLogitHook | None] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for attention in self.attentions:
            if _records_max_logits(attention.core_attention):
                self._hooks.append(None)
                continue
            hook = _MaxLogitHook(_softmax_scale(attention))
            self._hooks.append(hook)
            self._handles.append(
                attention.core_attention.register_forward_hook(hook, with_kwargs=True)
            )

    def max_logits(self) -> list[torch.Tensor | None]:
        """Per attention, this rank's ``(heads per partition,)`` max logits since the last clip."""
        result = []
        for attention, hook in zip(self.attentions, self._hooks, strict=True):
            if hook is None:
                result.append(attention.core_attention.current_max_attn_logits)
            else:
                result.append(hook.max_logits)
        return result

    @torch.no_grad()
    def clip(self) -> QKClipStats:
        """All-reduces the max logits over ``group``, scales the rows of heads above ``tau``.

        Resets the recorded max logits. Layers that recorded nothing since the last clip (on every
        rank) are left alone.
        """
        if not self.attentions:
            return QKClipStats(num_clipped_heads=0, max_logit=float("-inf"))
        local = self.max_logits()
        sizes = [a.num_attention_heads_per_partition for a in self.attentions]
        # On the params' device on every rank (NCCL all-reduces device tensors only; a rank that
        # recorded nothing must still contribute a tensor on the same device as the others).
        device = local_tensor(self.params[0][0]).device if self.params else torch.device("cpu")
        maxima = torch.cat(
            [
                m.detach().float().to(device)
                if m is not None
                else torch.full((n,), float("-inf"), device=device)
                for m, n in zip(local, sizes, strict=True)
            ]
        )
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group)
        num_clipped = 0
        maxima = maxima.cpu()  # a few numbers per layer; the loop below decides on the host
        for index, per_head in enumerate(maxima.split(sizes)):
            eta = head_clip_factors(per_head, self.threshold)
            clipped = int((eta < 1).sum())
            if clipped:
                num_clipped += clipped
                self._scale(index, eta)
        self._reset()
        return QKClipStats(num_clipped_heads=num_clipped, max_logit=float(maxima.max()))

    def remove_hooks(self) -> None:
        """Detaches the forward hooks (the recorded logits stay until the next ``clip``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _scale(self, index: int, eta: torch.Tensor) -> None:
        attention = self.attentions[index]
        scales = qkv_row_scales(
            eta, attention.num_query_groups_per_partition, attention.hidden_size_per_attention_head
        )
        for tensor, start in zip(self.params[index], self._row_starts[index], strict=True):
            scale_local_rows_(local_tensor(tensor).data, scales, start)

    def _reset(self) -> None:
        for attention, hook in zip(self.attentions, self._hooks, strict=True):
            if hook is None:
                attention.core_attention.current_max_attn_logits = None
            else:
                hook.max_logits = None


def _qkv_rows_per_partition(attention: SelfAttention) -> int:
    """Rows of the tensor-parallel-local ``linear_qkv``: per local group, its q heads, k and v."""
    groups = attention.num_query_groups_per_partition
    heads_per_group = attention.num_attention_heads_per_partition // groups
    return groups * (heads_per_group + 2) * attention.hidden_size_per_attention_head


def _default_params(attention: SelfAttention) -> list[torch.Tensor]:
    linear = attention.linear_qkv
    params = [linear.weight]
    bias = getattr(linear, "bias", None)
    if isinstance(bias, torch.Tensor) and bias.numel() > 0:
        params.append(bias)
    return params


def _check_supported(attention: SelfAttention, index: int) -> None:
    if not isinstance(attention, SelfAttention):
        raise ValueError(f"attention {index} is a {type(attention).__name__}, not SelfAttention")
    config = attention.config
    if config.qk_layernorm or config.qk_l2_norm:
        raise ValueError(
            f"attention {index}: QK layernorm normalizes q and k, so scaling their weights does "
            "not change the logits; QK-clip is for layers without it"
        )
    if config.attention_output_gate:
        raise ValueError(f"attention {index}: gated attention's qkv row layout is not supported")
    if attention.config.num_query_groups < attention.world_size:
        raise ValueError(
            f"attention {index}: fewer query groups ({config.num_query_groups}) than tensor "
            f"parallel ranks ({attention.world_size}) replicate key/value rows across TP ranks; "
            "not supported"
        )


def _records_max_logits(core_attention: torch.nn.Module) -> bool:
    """Whether TE's fused attention records ``current_max_attn_logits`` itself (TE >= 2.9)."""
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except ImportError:
        return False
    if not isinstance(TEDotProductAttention, type):  # None without Transformer Engine
        return False
    if not isinstance(core_attention, TEDotProductAttention):
        return False
    config: Any = core_attention.config  # megatron-core's TransformerConfig
    return bool(config.qk_clip or config.log_max_attention_logit)


def _softmax_scale(attention: SelfAttention) -> float:
    """The factor between ``q . k`` and the logit the softmax sees (query-key layer scaling's
    division by the layer number is undone inside the softmax, so it does not count)."""
    scale = attention.config.softmax_scale
    return scale if scale is not None else 1.0 / math.sqrt(attention.hidden_size_per_attention_head)

"""QK-clip (MuonClip, Kimi K2): bound each attention head's pre-softmax logits after a step.

After each optimizer step, for every attention head ``h`` whose largest pre-softmax logit
``max_h = max softmax_scale * q_h . k`` seen in the forward passes since the last clip exceeds the
threshold ``tau``, the query and key weight rows of the head are scaled so that its logits are
multiplied by ``eta_h = tau / max_h`` (``eta_h = 1`` for the other heads, including heads whose
max logit is negative or that saw no token): ``eta^alpha`` on the query side and
``eta^(1 - alpha)`` on the key side (``alpha``: ``--qk-clip-alpha``, default 0.5). Which rows those
are for MHA/GQA ``SelfAttention`` (``linear_qkv``, bias included) and for Multi-Latent Attention
(the query and ``linear_kv_up_proj`` up-projections; MLA's shared rotary key is left alone) is
``megatron_muon.fsdp.qk_clip_rows``; value rows are never touched.

Where the max logits come from: with TE's fused attention (TE >= 2.9, ``return_max_logit``) the core
attention records ``current_max_attn_logits`` itself and that is read; otherwise a forward hook on
``core_attention`` recomputes the scaled ``q k^T`` per head (masked entries excluded; causal masks
from ``attn_mask_type`` as well as explicit ``attention_mask``s) and keeps the running max, so the
local (non-TE) attention needs nothing more. Packed (THD) sequences are TE-only. QK-clip cannot act
through QK layernorm on the heads (MLA's norms on the compressed latents are fine), so it refuses
such layers, and MLA with DSA or ``cache_mla_latents``.

Sharding. Under tensor parallelism each TP rank holds whole heads (whole query groups) and their
rows, so the scales are TP-local; only the reported clipped-head count and max logit are
reduced over the TP group (``tp_group``). Under Megatron-FSDP each data-parallel rank holds a
contiguous row range ``[start, stop)`` of each matrix (``megatron_muon.engine.layout``) and scales
only
its own rows with the matching slice of the per-row scales. The max logits are all-reduced (MAX)
over the data-parallel group first, since its ranks saw different tokens and must agree on ``eta``.

Call ``QKClip.clip()`` after ``optimizer.step()`` on the params the optimizer updated (under
Megatron-FSDP: before the updated weights are installed into the compute buffers). Under
Megatron-FSDP, build ``QKClip`` when the optimizer is built, before the first forward: the default
``params`` are read from the modules then, while they are the DTensor row shards the optimizer
updates (a forward swaps in the unsharded compute weights, which the next install overwrites); or
pass the optimizer's params explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.enums import AttnMaskType

from megatron_muon.engine.layout import gather_row_layouts, local_tensor
from megatron_muon.fsdp.process_groups import row_group
from megatron_muon.fsdp.qk_clip_rows import (
    DEFAULT_ALPHA,
    HeadRows,
    check_clippable,
    find_attentions,
    head_rows,
    softmax_scale,
)

__all__ = [
    "QKClip",
    "build_qk_clip",
    "QKClipConfig",
    "QKClipStats",
    "find_attentions",
    "head_clip_factors",
    "scale_local_rows_",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class QKClipConfig:
    """MuonClip's settings, from which ``build_muon_optimizer(qk_clip=...)`` builds a ``QKClip``
    over every megatron-core ``SelfAttention`` and ``MultiLatentAttention`` of the model, run by the
    step wrapper after each step (``fsdp.arguments.qk_clip_config_from_args`` reads the flags).

    Attributes:
        threshold: ``tau`` > 0, in units of pre-softmax logits (``--qk-clip-threshold``).
        alpha: the query side's share of each clipped head's factor ``eta`` (queries
            ``eta^alpha``, keys ``eta^(1 - alpha)``; ``--qk-clip-alpha``), in (0, 1).
    """

    threshold: float
    alpha: float = DEFAULT_ALPHA

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"QK-clip threshold must be positive, got {self.threshold}")
        if not 0 < self.alpha < 1:
            # Megatron-LM's rule for --qk-clip-alpha.
            raise ValueError(f"QK-clip alpha must be in (0, 1), got {self.alpha}")


def head_clip_factors(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """``eta_h = tau / max_h`` where ``max_h > tau``, else 1 (also for negative or -inf maxima,
    which megatron-core's ``clamp(tau / max, max=1)`` would make negative).

    ``(H,)`` in, ``(H,)`` fp32 out.
    """
    max_logits = max_logits.float()
    clipped = max_logits > threshold
    return torch.where(clipped, threshold / max_logits.clamp_min(threshold), 1.0)


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


@dataclass(frozen=True, slots=True)
class QKClipStats:
    """One clip: heads clipped over all layers and the largest max logit seen (over every TP
    partition's heads when ``QKClip`` has a ``tp_group``, else over this partition's)."""

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
    """MuonClip's QK-clip over megatron-core attention layers (see the module docstring).

    Args:
        attentions: the ``SelfAttention`` / ``MultiLatentAttention`` layers to clip
            (``find_attentions(model)``).
        threshold: ``tau`` > 0, in units of pre-softmax logits (``--qk-clip-threshold``).
        group: data-parallel group (``dp_cp``) whose ranks see different tokens and over which
            the weights' rows are sharded; ``None`` when not distributed.
        params: per attention, the tensors whose rows to scale, standing in for
            ``qk_clip_rows.head_rows(attention)``'s tensors in that order (``linear_qkv`` weight
            and bias; MLA: the query and kv up-projection weights), each with those rows (dim 0):
            plain tensors or Megatron-FSDP ``Shard(0)`` DTensors. Default: the modules' own.
        alpha: the query side's share of each head's factor, in (0, 1) (``--qk-clip-alpha``).
        tp_group: the tensor-parallel group, over which ``clip()``'s reported count of clipped
            heads is summed and the max logit maxed (the scaling itself is TP-local).

    Collective over ``group`` at construction (row layouts) and in ``clip()`` (one all-reduce,
    plus two small ones over ``tp_group`` when it has more than one rank).
    """

    def __init__(
        self,
        attentions: Sequence[Attention],
        threshold: float,
        group: dist.ProcessGroup | None = None,
        params: Sequence[Sequence[torch.Tensor]] | None = None,
        *,
        alpha: float = DEFAULT_ALPHA,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        QKClipConfig(threshold=threshold, alpha=alpha)  # checks both
        if params is not None and len(params) != len(attentions):
            raise ValueError(f"{len(params)} param lists for {len(attentions)} attention layers")
        for index, attention in enumerate(attentions):
            check_clippable(attention, index)
        self.attentions = list(attentions)
        self.threshold = float(threshold)
        self.alpha = float(alpha)
        self.group = group
        self.tp_group = tp_group
        self._rows: list[list[HeadRows]] = [head_rows(a, self.alpha) for a in self.attentions]
        self.params = self._params(params)
        self._row_starts = self._locate_rows()
        self._hooks: list[_MaxLogitHook | None] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for attention in self.attentions:
            if _records_max_logits(attention.core_attention):
                self._hooks.append(None)
                continue
            hook = _MaxLogitHook(softmax_scale(attention))
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
        rank) are left alone. The returned count covers every TP partition's heads when
        ``tp_group`` is given, else this partition's.
        """
        if not self.attentions:
            return QKClipStats(num_clipped_heads=0, max_logit=float("-inf"))
        local = self.max_logits()
        sizes = [a.num_attention_heads_per_partition for a in self.attentions]
        # On the params' device on every rank (NCCL all-reduces device tensors only; a rank that
        # recorded nothing must still contribute a tensor on the same device as the others).
        device = local_tensor(self.params[0][0]).device
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
        for index, per_head in enumerate(maxima.cpu().split(sizes)):  # decided on the host
            eta = head_clip_factors(per_head, self.threshold)
            clipped = int((eta < 1).sum())
            if clipped:
                num_clipped += clipped
                self._scale(index, eta)
        self._reset()
        return self._over_tensor_parallel(num_clipped, maxima.max())

    def remove_hooks(self) -> None:
        """Detaches the forward hooks (the recorded logits stay until the next ``clip``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _params(self, params: Sequence[Sequence[torch.Tensor]] | None) -> list[list[torch.Tensor]]:
        if params is None:
            return [[rows.param for rows in of] for of in self._rows]
        result = [list(tensors) for tensors in params]
        for index, (tensors, of) in enumerate(zip(result, self._rows, strict=True)):
            if len(tensors) != len(of):
                raise ValueError(
                    f"attention {index}: {len(tensors)} QK-clip params for its "
                    f"{len(of)} tensors {[rows.name for rows in of]}"
                )
        return result

    def _locate_rows(self) -> list[list[int]]:
        """Per attention and param, this rank's first row; checks each param's rows.

        Rows of each param's TP-local matrix: under tensor parallelism a Megatron-FSDP DTensor has
        the global shape of the unsplit weight, which the layouts account for.
        """
        flat = [tensor for tensors in self.params for tensor in tensors]
        layouts = iter(gather_row_layouts(flat, self.group) if flat else [])
        rank = dist.get_rank(self.group) if self.group is not None else 0
        starts: list[list[int]] = []
        for index, (tensors, of) in enumerate(zip(self.params, self._rows, strict=True)):
            starts.append([])
            for tensor, rows in zip(tensors, of, strict=True):
                layout = next(layouts)
                if layout.num_rows != rows.num_rows:
                    raise ValueError(
                        f"attention {index}: the QK-clip param for {rows.name} has shape "
                        f"{tuple(tensor.shape)} ({layout.num_rows} rows per TP partition), not "
                        f"the {rows.num_rows} rows of this TP rank's {rows.name}"
                    )
                starts[-1].append(layout.ranges[rank][0])
        return starts

    def _scale(self, index: int, eta: torch.Tensor) -> None:
        triples = zip(self.params[index], self._rows[index], self._row_starts[index], strict=True)
        for tensor, rows, start in triples:
            scale_local_rows_(local_tensor(tensor).data, rows.row_scales(eta), start)

    def _over_tensor_parallel(self, num_clipped: int, max_logit: torch.Tensor) -> QKClipStats:
        """The stats over all TP partitions' heads (sum of counts, max of max logits)."""
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            count = torch.tensor([num_clipped], dtype=torch.int64, device=max_logit.device)
            dist.all_reduce(count, group=self.tp_group)
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=self.tp_group)
            num_clipped = int(count.item())
        return QKClipStats(num_clipped_heads=num_clipped, max_logit=float(max_logit))

    def _reset(self) -> None:
        for attention, hook in zip(self.attentions, self._hooks, strict=True):
            if hook is None:
                attention.core_attention.current_max_attn_logits = None
            else:
                hook.max_logits = None


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


def build_qk_clip(
    config: QKClipConfig | None,
    chunks: list[torch.nn.Module],
    pg_collection: Any,
    fsdp_modules: list[Any],
) -> QKClip | None:
    """MuonClip's ``QKClip`` for ``config`` (``build_muon_optimizer``), or None without one.

    Built now, while every clipped weight (``linear_qkv``; MLA's query and kv up-projections) is
    the DTensor row shard the optimizer updates (a forward swaps in the compute weights); max
    logits are all-reduced over the dense data-parallel group (``dp_cp``), whose ranks see
    different tokens; the clipped-head count is summed over ``tp``.
    """
    if config is None:
        return None
    attentions = find_attentions(chunks)
    if not attentions:
        raise ValueError(
            f"QK-clip threshold {config.threshold} but the model has no megatron-core "
            "SelfAttention or MultiLatentAttention layer to clip"
        )
    group, _ = row_group(pg_collection, fsdp_modules, is_expert=False)
    tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    return QKClip(attentions, config.threshold, group=group, alpha=config.alpha, tp_group=tp_group)

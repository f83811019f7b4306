"""Multi-Latent Attention on megatron-core's local core attention: ``k_channels`` / ``v_channels``.

megatron-core's ``MultiLatentAttention`` builds its core attention with ``k_channels`` (the query /
key head size, ``qk_head_dim + qk_pos_emb_head_dim``) and ``v_channels`` (``v_head_dim``), which
Transformer Engine's attention takes; the local ``DotProductAttention`` of megatron-core 0.19 does
not (``TypeError: ... unexpected keyword argument 'k_channels'``), so MLA with
``--transformer-impl local`` fails to build, on GPUs as on CPUs. ``patch()`` wraps its
``__init__``: both keywords are accepted, the context's width becomes ``v_channels`` per head
(the local attention otherwise takes ``kv_channels``), and the head size behind a default softmax
scale becomes ``k_channels`` (MLA passes its own scale, with YaRN's mscale). Nothing changes for a
caller that passes neither keyword, nor once megatron-core takes them itself (checked by the
signature). Applied by ``integrations.megatron_lm.install()``; a custom trainer building an MLA
model with the local spec calls ``patch()`` before building it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from typing import Any

from megatron_muon.integrations.megatron_version import check_megatron_core_version

__all__ = ["patch", "patched"]

_MARK = "_megatron_muon_mla_channels"


def patched() -> bool:
    """Whether the local ``DotProductAttention`` accepts ``k_channels`` / ``v_channels`` now."""
    module = importlib.import_module("megatron.core.transformer.dot_product_attention")
    return "k_channels" in inspect.signature(module.DotProductAttention.__init__).parameters


def patch() -> None:
    """Makes the local ``DotProductAttention`` take MLA's ``k_channels`` / ``v_channels``.

    Idempotent. Raises ``RuntimeError`` on a megatron-core outside the supported range.
    """
    check_megatron_core_version(__name__)
    module = importlib.import_module("megatron.core.transformer.dot_product_attention")
    cls = module.DotProductAttention
    if patched():
        return
    cls.__init__ = _with_channels(cls.__init__)


def _with_channels(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(
        self: Any,
        *args: Any,
        k_channels: int | None = None,
        v_channels: int | None = None,
        **kw: Any,
    ) -> None:
        original(self, *args, **kw)
        heads = self.config.num_attention_heads
        tp_size = heads // self.num_attention_heads_per_partition
        if v_channels is not None:
            # [sq, b, np, v_channels] -> [sq, b, np * v_channels]: the context's width.
            self.hidden_size_per_partition = v_channels * heads // tp_size
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
            if _softmax_scale(original, args, kw) is None:
                self.softmax_scale = _default_scale(self, k_channels)

    setattr(__init__, _MARK, True)
    # The signature tells patched() (and megatron's build_module) the keywords are taken.
    parameters = list(inspect.signature(original).parameters.values())
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
        for name in ("k_channels", "v_channels")
    ]
    keep = [p for p in parameters if p.kind != inspect.Parameter.VAR_KEYWORD]
    setattr(__init__, "__signature__", inspect.Signature([*keep, *extra]))  # noqa: B010
    return __init__


def _softmax_scale(original: Any, args: tuple, kwargs: dict) -> Any:
    """The ``softmax_scale`` the caller passed (positionally or by name), else None."""
    bound = inspect.signature(original).bind_partial(None, *args, **kwargs)
    return bound.arguments.get("softmax_scale")


def _default_scale(attention: Any, head_size: int) -> float:
    """The local attention's default scale, 1/sqrt(head size), with its layer-number coefficient
    when ``apply_query_key_layer_scaling`` is on."""
    scale = 1.0 / math.sqrt(head_size)
    if attention.config.apply_query_key_layer_scaling:
        scale /= attention.layer_number
    return scale

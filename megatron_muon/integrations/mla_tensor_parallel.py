"""Multi-latent attention at TP > 1, column-parallel down projections: the shared k_pe gradient.

megatron-core 0.19.2 ``MLASelfAttention.get_query_key_value_tensors`` (multi_latent_attention.py
~:735-747): when ``linear_kv_down_proj`` is a ``ColumnParallelLinear`` (the local spec), each TP
rank computes its columns of ``kv_combined = [kv_compressed | k_pos_emb]`` and
``gather_from_tensor_model_parallel_region`` gathers them. ``k_pos_emb`` (the rotary key part,
shared by every head) is then used by each rank's own heads. The gather's backward keeps each
rank's own columns of the incoming gradient, so the ``k_pos_emb`` columns (held by the last TP
rank) receive only that rank's heads' share of their gradient; the other ranks' shares are
dropped. (``kv_compressed`` is fine: it flows into the column-parallel ``linear_kv_up_proj``, whose
backward sums over TP.) Measured in Megatron-LM's loop, tiny MLA GPT, TP = 2 against one rank
continuing from the same checkpoint: grad norm 1.6755552 vs 1.6755499 at the first iteration
after the load, 1.94876 vs 1.94941 at the next (losses drift apart from there); MoE + EP = 2 the
same. Transformer Engine's spec takes the other branch (a duplicated ``linear_kv_down_proj``).

The fix, applied by ``megatron_lm.install()``: a forward hook on each such ``linear_kv_down_proj``
marks its output; the gather, as ``multi_latent_attention`` calls it, passes a marked input's
result through ``_SumPositionGradOverTP`` (forward: identity; backward: the ``k_pos_emb``
columns of the gradient summed over the TP group, the rest unchanged), so every rank hands back
the full gradient of its columns.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["install"]

_MARK = "_megatron_muon_k_pos_emb"
_INSTALLED = False


class _SumPositionGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the last ``width`` columns of the gradient over ``group``.

    ``gathered``: ``(..., kv_lora_rank + qk_pos_emb_head_dim)``, replicated over the TP group.
    """

    @staticmethod
    def forward(ctx: Any, gathered: torch.Tensor, width: int, group: Any) -> torch.Tensor:
        ctx.width, ctx.group = width, group
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone()
        position = grad[..., -ctx.width :].contiguous()
        dist.all_reduce(position, group=ctx.group)
        grad[..., -ctx.width :] = position
        return grad, None, None


def _mark_output(width: int, group: Any) -> Any:
    def hook(module: Any, inputs: Any, output: Any) -> None:
        tensor = output[0] if isinstance(output, tuple) else output
        setattr(tensor, _MARK, (width, group))

    return hook


def _hooking_init(init: Any) -> Any:
    @functools.wraps(init)
    def init_with_hook(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        from megatron.core.tensor_parallel import ColumnParallelLinear

        down = getattr(self, "linear_kv_down_proj", None)
        group = getattr(self, "tp_group", None)
        if isinstance(down, ColumnParallelLinear) and group is not None and group.size() > 1:
            down.register_forward_hook(_mark_output(self.config.qk_pos_emb_head_dim, group))

    return init_with_hook


def _summing_marked(gather: Any) -> Any:
    @functools.wraps(gather)
    def gather_summing_k_pos_emb_grad(input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        output = gather(input_, *args, **kwargs)
        marked = getattr(input_, _MARK, None)
        if marked is None:
            return output
        width, group = marked
        return _SumPositionGradOverTP.apply(output, width, group)

    return gather_summing_k_pos_emb_grad


def install() -> None:
    """Patches ``MLASelfAttention.__init__`` and the gather its module calls (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    mla: Any = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    mla.MLASelfAttention.__init__ = _hooking_init(mla.MLASelfAttention.__init__)
    mla.gather_from_tensor_model_parallel_region = _summing_marked(
        mla.gather_from_tensor_model_parallel_region
    )
    _INSTALLED = True

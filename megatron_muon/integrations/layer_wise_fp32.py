"""megatron-core's own distributed Muon (``LayerWiseDistributedOptimizer``) trains in fp32.

Megatron-LM's ``--optimizer muon --use-distributed-optimizer`` (DDP, no Megatron-FSDP) builds
``LayerWiseDistributedOptimizer`` over the raw emerging-optimizers ``TensorParallelMuon``, and
megatron-core 0.19.2 wraps that raw optimizer in a Megatron optimizer only under ``--bf16``
(``Float16OptimizerWithFloat16Params``, layer_wise_optimizer.py:513). In fp32 the chain holds
the raw torch optimizer, so the loop's first backward stops at ``ChainedOptimizer.
get_loss_scale`` (``'TensorParallelMuon' object has no attribute 'get_loss_scale'``, measured
on 4 CPU ranks, TP = 2 x DP = 2), and were it to get past that, nothing would copy DDP's
``main_grad`` into ``grad`` before the step, nor would ``ChainedOptimizer.__init__`` find a
``config`` on its children (it reads the first child's).

The fix (``patch()``, applied by ``megatron_lm.install()`` under its megatron-core version
check): after the original constructor, in fp32, each raw child is wrapped in megatron-core's
``FP32Optimizer`` with its ``init_state_fn``, as the same factory does for Muon without
LayerWise (``_get_megatron_emerging_optimizer``: ``FP32Optimizer(optimizer, config,
init_state_fn)``), and the chain is set up again over the wrapped children the way the
constructor does (``ChainedOptimizer.__init__``, then ``model_chunks``). The wrapper adds no
arithmetic: ``main_grad`` (fp32) becomes ``grad``, the loss scale is 1, the inner step is the raw
optimizer's step. The shard assignment (``shard_params``) is untouched: it narrowed the same
param-group dicts the wrapper reads. Under ``--bf16`` nothing changes. Measured on the path
Megatron-LM's config-container builder sets up (``pretrain_gpt.py``'s: no precomputed param
layout, so LayerWise holds both children, Muon over the matrices and AdamW over the rest); the
precomputed-layout path (``training.get_model``: AdamW on a separate ``DistributedOptimizer``)
was not run in fp32.

Its state dicts are nested one level down, under ``"optimizer"``, as the bf16 wrapper's are
(``LayerWiseDistributedOptimizer.sharded_state_dict`` reads ``sd["optimizer"]["state"]`` of each
child: ``KeyError: 'optimizer'`` at the first ``torch_dist`` save otherwise, measured); so an fp32
``torch_dist`` checkpoint holds the bf16 one's keys (``chained_<i>.optimizer.state.
momentum_buffer.<key>``, Adam's ``exp_avg`` / ``exp_avg_sq``, the groups with ``common_step``)
but the fp32 main params (``fp32_param``), which an fp32 run has none of: the weights are the
model's own.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["patch"]

_MARK = "_megatron_muon_wraps_fp32"


@functools.cache
def _layer_wise_fp32_class() -> type:
    """megatron-core's ``FP32Optimizer`` with its state dicts under ``"optimizer"`` (module
    docstring)."""
    from megatron.core.optimizer.optimizer import FP32Optimizer

    class LayerWiseFP32Optimizer(FP32Optimizer):
        """An fp32 child of ``LayerWiseDistributedOptimizer``: ``FP32Optimizer`` whose sharded
        state dict is ``{"optimizer": <FP32Optimizer's>}``, as the bf16 child's is; its load
        takes that or the plain state dict (``--ckpt-format torch``'s ``state_dict()``)."""

        def sharded_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return {"optimizer": super().sharded_state_dict(*args, **kwargs)}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            nested = "optimizer" in state_dict and "state" not in state_dict
            super().load_state_dict(state_dict["optimizer"] if nested else state_dict)

    return LayerWiseFP32Optimizer


def _wrap_fp32_children(optimizer: Any, config: Any, init_state_fns: list[Any] | None) -> None:
    """``optimizer`` (a constructed ``LayerWiseDistributedOptimizer``): its raw torch children
    wrapped in ``FP32Optimizer`` and the chain set up again over them (module docstring)."""
    import torch
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    children = list(optimizer.chained_optimizers)
    if not any(isinstance(child, torch.optim.Optimizer) for child in children):
        return
    functions = init_state_fns or [lambda *_: None] * len(children)
    fp32_optimizer = _layer_wise_fp32_class()
    wrapped = [
        fp32_optimizer(child, config, function)
        if isinstance(child, torch.optim.Optimizer)
        else child
        for child, function in zip(children, functions, strict=True)
    ]
    model_chunks = optimizer.model_chunks
    ChainedOptimizer.__init__(optimizer, wrapped)
    optimizer.model_chunks = model_chunks


def patch() -> None:
    """``LayerWiseDistributedOptimizer.__init__`` wraps its raw children in fp32 (module
    docstring). Idempotent."""
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    original = LayerWiseDistributedOptimizer.__init__
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def __init__(
        self: Any,
        optimizers: Any,
        config: Any,
        pg_collection: Any = None,
        init_state_fn_list: Any = None,
        model_chunks: Any = None,
    ) -> None:
        original(self, optimizers, config, pg_collection, init_state_fn_list, model_chunks)
        if not config.bf16:
            _wrap_fp32_children(self, config, init_state_fn_list)

    setattr(__init__, _MARK, True)
    LayerWiseDistributedOptimizer.__init__ = __init__

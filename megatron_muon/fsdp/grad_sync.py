"""Megatron-FSDP's gradients reduced exactly once before an optimizer step, whatever the loop did.

When does Megatron-FSDP (megatron_fsdp 0.6.1; megatron-core's vendored copy is the same code) reduce
the gradients of a ``MegatronFSDP`` module?

- **In the backward**, through its grad-reduce pipeline (asynchronous all-reduce / reduce-scatter,
  waited for and reset at the end of the backward): always under ``optim_grads`` and
  ``optim_grads_params``; under ``no_shard`` and ``optim`` only when ``is_last_microbatch`` is set
  (``no_sync()`` sets it False inside and True on exit; it is absent, i.e. False, until the first
  ``no_sync()``) or ``model_auto_sync`` is on (``fully_shard_model``'s default
  ``sync_model_each_microbatch=True``; megatron-core's ``FullyShardedDataParallel`` turns it off).
  With ``model_auto_sync`` the backward then also calls ``finish_grad_sync()`` itself.
- **In ``finish_grad_sync()``**, only with ``overlap_grad_reduce=False`` (``start_grad_sync``: a
  synchronous all-reduce / reduce-scatter of the whole buffer), *whether or not the backward
  already reduced*. With ``overlap_grad_reduce=True`` it only waits for the pipeline, *whether or
  not the backward launched anything*.

So ``finish_grad_sync()`` is right only when "the backward reduced" equals
``overlap_grad_reduce``: in a plain loop (zero_grad -> backward -> step) megatron-core's wrapper
with ``overlap_grad_reduce=True`` under no_shard / optim never reduced, and with
``overlap_grad_reduce=False`` after a ``no_sync()`` block it reduced twice (measured:
docs/megatron-fsdp-measurements.md). ``finish_grad_sync_once`` reads which case it is in from the
pipeline's own bookkeeping: the backward hooks point ``param.main_grad`` of each raw param at its
unreduced gradient, and the pipeline's ``reset()`` after a reduction drops those references. It
then reduces exactly once:

================================  ==========================  ==================================
                                  ``overlap_grad_reduce=True``  ``overlap_grad_reduce=False``
================================  ==========================  ==================================
gradients not reduced yet          launch the pipeline's        ``finish_grad_sync()`` (reduces)
                                   reduction, then finish
reduced in the last backward       ``finish_grad_sync()``       ``finish_grad_sync()`` told the
                                   (waits)                      reduction already ran (waits)
================================  ==========================  ==================================

and sets ``is_last_microbatch`` for the next backwards (``prepare_next_backwards``): False, so that
plain backwards accumulate locally and the next step reduces once (a loop that overlaps the
reduction with the last backward runs it right after a ``with module.no_sync():`` block, as
Megatron's schedule does); True under HSDP, whose DP-outer reduction runs only in a backward with
``is_last_microbatch`` (or ``model_auto_sync``) set, so HSDP accumulates over micro-batches only
under ``no_sync()``.

One setting cannot be made right after the fact: ``fully_shard_model`` with
``sync_model_each_microbatch=True`` and ``overlap_grad_reduce=False`` under ``optim`` reduces twice
inside the backward (the pipeline, then its own ``finish_grad_sync``), which scales the gradient;
``check_sync_settings`` refuses it. (Under ``no_shard`` the second all-reduce of
equal replicas changes nothing.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "check_sync_settings",
    "finish_grad_sync_once",
    "has_unreduced_grads",
    "prepare_next_backwards",
]


def check_sync_settings(module: Any) -> None:
    """Refuses a ``MegatronFSDP`` whose own backward reduces gradients twice.

    Raises:
        ValueError: ``model_auto_sync`` (``sync_model_each_microbatch=True``) with
            ``overlap_grad_reduce=False`` under ``optim``.
    """
    if (
        module.data_parallel_sharding_strategy == "optim"
        and module.model_auto_sync
        and not module.ddp_config.overlap_grad_reduce
    ):
        raise ValueError(
            "Megatron-FSDP with sync_model_each_microbatch=True (fully_shard_model's default) and "
            "overlap_grad_reduce=False under the 'optim' strategy reduce-scatters every gradient "
            "twice in the backward (its grad-reduce pipeline, then finish_grad_sync's synchronous "
            "reduce-scatter), which scales the gradient; pass overlap_grad_reduce=True (the "
            "default) or sync_model_each_microbatch=False"
        )


def _reduced_params(module: Any) -> Iterator[Any]:
    """The raw (compute) params whose gradients the grad-reduce pipeline reduces."""
    for group in module.param_and_grad_buffer.parameter_groups:
        if group.requires_grad and group.main_grad_buffer is not None:
            yield from (p for p in group.params if p.requires_grad)


def has_unreduced_grads(module: Any) -> bool:
    """True when a backward accumulated gradients that no reduction has consumed yet.

    The backward hooks set ``param.main_grad`` (a view of the gradient buffer) on every raw param
    they accumulate; the grad-reduce pipeline's ``reset()`` after a reduction sets it to None.
    """
    return any(getattr(p, "main_grad", None) is not None for p in _reduced_params(module))


def _launch_grad_reduce(module: Any) -> None:
    """What the last backward would have launched with ``is_last_microbatch`` set."""
    module.grad_reduce_pipeline.reduce_gradients(
        list(_reduced_params(module)),
        suggested_queue_capacity=module.suggested_RS_queue_capacity,
        outer_fsdp_group_grad_reduce=module.get_distributed_index().use_hybrid_fsdp,
    )


@contextmanager
def _reduction_already_ran(module: Any) -> Iterator[None]:
    """``finish_grad_sync`` waits for the pipeline (done) instead of reducing a second time.

    ``synchronize_gradient_reduce`` is the only reader of ``overlap_grad_reduce`` in
    ``finish_grad_sync``; the setting is restored on exit.
    """
    config = module.ddp_config
    saved = config.overlap_grad_reduce
    config.overlap_grad_reduce = True
    try:
        yield
    finally:
        config.overlap_grad_reduce = saved


def finish_grad_sync_once(module: Any) -> None:
    """Reduced gradients attached to ``module``'s optimizer params, reduced exactly once.

    Collective over the module's data-parallel groups (every rank takes the same branch: the
    state it reads follows from the loop, which every rank runs alike). A no-op when no backward
    ran since the last ``finish_grad_sync()`` (the loop's own, or the one ``model_auto_sync`` runs
    in the backward).
    """
    if module.microbatch_count == 0:
        return
    pending = has_unreduced_grads(module)
    overlap = module.ddp_config.overlap_grad_reduce
    if pending and overlap:
        _launch_grad_reduce(module)
        module.finish_grad_sync()
    elif not pending and not overlap:
        with _reduction_already_ran(module):
            module.finish_grad_sync()
    else:
        module.finish_grad_sync()
    prepare_next_backwards(module)


def prepare_next_backwards(module: Any) -> None:
    """``is_last_microbatch`` for the backwards before the next step (module docstring).

    Not under HSDP: False, so plain backwards accumulate until the step reduces once (reducing an
    accumulating ``optim`` buffer in place on every backward would corrupt it). Under HSDP: True,
    as Megatron's schedule leaves it, because only such a backward runs the DP-outer reduction.
    """
    module.is_last_microbatch = bool(module.get_distributed_index().use_hybrid_fsdp)

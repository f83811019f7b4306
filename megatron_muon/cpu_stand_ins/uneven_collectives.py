"""CPU stand-ins for the uneven all-gathers and reduce-scatter of megatron-core on gloo.

With MoE and tensor parallelism > 1 (expert TP > 1), megatron-core's token dispatchers gather the
tokens of the expert-TP group and reduce-scatter them back with per-rank row counts that differ
(``gather_from_sequence_parallel_region(..., output_split_sizes=...)`` and its backward;
megatron-core 0.19.2 ``tensor_parallel/mappings.py`` ``_gather_along_first_dim`` /
``_reduce_scatter_along_first_dim``). Those pass lists of unequal tensors to
``torch.distributed.all_gather`` / ``reduce_scatter``; NCCL takes them, gloo does not
("ProcessGroupGloo::allgather: invalid tensor size").

The stand-ins compute the same results with collectives gloo has, only where split sizes are
given (the even paths are untouched):

- all-gather: every rank's rows padded to the largest count, an even ``all_gather``, the padding
  cut off (the gathered values are the inputs, bit for bit);
- reduce-scatter: an ``all_reduce`` (sum) of the whole input, then this rank's rows (the same sum
  over the same ranks; on CPU, only the order of the additions may differ).

megatron-core's own distributed Muon (``LayerWiseDistributedOptimizer``) without a precomputed
param layout (the path Megatron-LM's config-container builder takes, ``models/dist_utils.py``,
which computes a layout only for the plain distributed optimizer) all-gathers each rank's updated
params as one flat tensor per rank, of each rank's own length (``allgather_params``,
layer_wise_optimizer.py:772: "PyTorch's NCCL backend handles uneven sizes in all_gather"); gloo
refuses it (measured, 4 CPU ranks, TP = 2 x DP = 2: "ProcessGroupGloo::allgather: invalid tensor
size at index 0 (expected (33440), got (25248))"). While ``allgather_params`` runs,
``torch.distributed.all_gather`` over a list of unequal 1-D tensors pads each to the longest,
gathers evenly and copies each rank's own length back into its slot (``uneven_all_gather_into``;
the values bit for bit); an even list goes to the original.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_muon.cpu_stand_ins._replace import import_optional, replace_once, set_stand_in

__all__ = ["patch", "uneven_all_gather", "uneven_all_gather_into", "uneven_reduce_scatter"]


def uneven_all_gather(
    local: torch.Tensor, split_sizes: Sequence[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Rows of every rank of ``group``, in rank order: ``(sum(split_sizes), *local.shape[1:])``.

    ``local``: this rank's ``split_sizes[group.rank()]`` rows. Collective over ``group``.
    """
    largest = max(int(size) for size in split_sizes)
    padded = local.new_zeros((largest, *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in split_sizes]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    return torch.cat(
        [rows[: int(size)] for rows, size in zip(gathered, split_sizes, strict=True)], dim=0
    )


def uneven_all_gather_into(
    outputs: list[torch.Tensor], local: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    """``dist.all_gather(outputs, local, group)`` for 1-D ``outputs`` of unequal lengths, as
    NCCL does it: ``outputs[r]`` gets rank ``r``'s ``local`` (whose length is ``outputs[r]``'s).
    Collective over ``group``."""
    largest = max(int(output.numel()) for output in outputs)
    padded = local.new_zeros(largest)
    padded[: local.numel()] = local
    gathered = [torch.empty_like(padded) for _ in outputs]
    dist.all_gather(gathered, padded, group=group)
    for output, rows in zip(outputs, gathered, strict=True):
        output.copy_(rows[: output.numel()])


def uneven_reduce_scatter(
    full: torch.Tensor, split_sizes: Sequence[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """This rank's rows of the sum over ``group`` of ``full`` (``(sum(split_sizes), ...)``).

    Returns ``(split_sizes[group.rank()], *full.shape[1:])``. Collective over ``group``.
    """
    summed = full.contiguous().clone()
    dist.all_reduce(summed, group=group)
    start = sum(int(size) for size in split_sizes[: group.rank()])
    return summed[start : start + int(split_sizes[group.rank()])].clone()


def _gather(original: Any) -> Any:
    @functools.wraps(original)
    def gather(input_: Any, group: Any, output_split_sizes: Any = None, *args: Any, **kw: Any):
        if output_split_sizes is None or group is None or group.size() == 1:
            return original(input_, group, output_split_sizes, *args, **kw)
        return uneven_all_gather(input_, output_split_sizes, group)

    return gather


def _reduce_scatter(original: Any) -> Any:
    @functools.wraps(original)
    def reduce_scatter(input_: Any, group: Any, input_split_sizes: Any = None, *args: Any, **kw):
        if input_split_sizes is None or group is None or group.size() == 1:
            return original(input_, group, input_split_sizes, *args, **kw)
        return uneven_reduce_scatter(input_, input_split_sizes, group)

    return reduce_scatter


@contextlib.contextmanager
def _uneven_all_gather_lists() -> Iterator[None]:
    """Within: ``dist.all_gather`` over 1-D tensors of unequal lengths is
    ``uneven_all_gather_into`` (module docstring); any other call is the original."""
    original = dist.all_gather

    def all_gather(outputs: Any, local: Any, group: Any = None, async_op: bool = False) -> Any:
        sizes = {int(output.numel()) for output in outputs}
        if len(sizes) == 1 or async_op or any(output.ndim != 1 for output in outputs):
            return original(outputs, local, group=group, async_op=async_op)
        uneven_all_gather_into(outputs, local, group)
        return None

    set_stand_in(dist, "all_gather", all_gather)
    try:
        yield
    finally:
        set_stand_in(dist, "all_gather", original)


def _layer_wise_allgather(original: Any) -> Any:
    @functools.wraps(original)
    def allgather_params(self: Any) -> None:
        with _uneven_all_gather_lists():
            original(self)

    return allgather_params


def patch() -> None:
    """The uneven paths of megatron-core's first-dim all-gather and reduce-scatter, and of
    ``LayerWiseDistributedOptimizer.allgather_params``, on gloo."""
    mappings = import_optional("megatron.core.tensor_parallel.mappings")
    if mappings is not None:
        replace_once(mappings, "_gather_along_first_dim", _gather)
        replace_once(mappings, "_reduce_scatter_along_first_dim", _reduce_scatter)
    layer_wise = import_optional("megatron.core.optimizer.layer_wise_optimizer")
    if layer_wise is not None:
        owner = layer_wise.LayerWiseDistributedOptimizer
        replace_once(owner, "allgather_params", _layer_wise_allgather)

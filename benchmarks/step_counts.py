"""What one optimizer step costs a rank, measured the same way for ours and every peer: its time
(stepped in turn with the others), transient memory, and, counted while it runs,
matmul FLOPs (torch's ``FlopCounterMode``: NS dominates them) and the bytes this rank hands to
collectives (a dispatch mode over torch's c10d and functional-collective ops: the input tensors of
each, i.e. what the rank contributes; an all-gather counts its shard, an all-reduce its tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.optimizer_step import peak_step_memory, time_samples

__all__ = ["count_step", "max_and_mean", "step_figures"]

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
# Schema argument names that hold what a rank contributes (inputs), per op family.
_CONTRIBUTED = ("input", "inputs", "input_tensor", "input_tensors", "tensors", "self")


# Ops of those namespaces that move no data: a functional collective's wait, and the wrapper DTensor
# puts around its output (it would count the gathered tensor once more).
_NOT_COLLECTIVES = frozenset({"wait_tensor", "wait_tensors", "_wrap_tensor_autograd"})


def _op_name(func: Any) -> str:
    """``_c10d_functional.wait_tensor.default`` -> ``wait_tensor``."""
    return func._schema.name.split("::")[-1]


class _CollectiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensors this rank passes into collectives while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVE_NAMESPACES and _op_name(func) not in _NOT_COLLECTIVES:
            for argument, value in zip(func._schema.arguments, args, strict=False):
                if argument.name in _CONTRIBUTED:
                    self.bytes += sum(
                        t.numel() * t.element_size()
                        for t in tree_leaves(value)
                        if isinstance(t, torch.Tensor)
                    )
        return func(*args, **kwargs)


def count_step(step: Callable[[], object]) -> dict[str, int]:
    """``{"flops", "collective_bytes"}`` of this rank during one ``step()``."""
    flops = FlopCounterMode(display=False)
    collectives = _CollectiveBytes()
    # Eager: torch.compile'd code (muon-fsdp2's NS) refuses to run under a dispatch mode; the
    # same operations run uncompiled and are counted.
    with torch.compiler.set_stance("force_eager"), flops, collectives:
        step()
    return {"flops": int(flops.get_total_flops()), "collective_bytes": collectives.bytes}


def max_and_mean(value: int) -> dict[str, float]:
    """Over the ranks of the default group: ``{"max", "mean", "max_over_mean"}`` of ``value``."""
    values: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(values, value)
    mean = sum(values) / len(values)
    return {"max": max(values), "mean": mean, "max_over_mean": max(values) / mean if mean else 1.0}


def step_figures(optimizers: dict, device: str, warmup: int, repeats: int) -> dict:
    """Per optimizer (rank 0's view): step seconds stepped in turn (median, min, max), one step's
    transient memory, and one more step's matmul FLOPs and bytes handed to collectives per rank
    (max and mean over the ranks; ``benchmarks.step_counts``)."""
    samples = time_samples(optimizers, device, warmup, repeats)
    memory = peak_step_memory(optimizers, device)
    figures = {}
    for name, values in samples.items():
        counts = count_step(optimizers[name].step)
        figures[name] = {
            "seconds": median(values),
            "min_s": min(values),
            "max_s": max(values),
            "transient_bytes": memory[name],
            "flops": max_and_mean(counts["flops"]),
            "collective_bytes": max_and_mean(counts["collective_bytes"]),
        }
    return figures

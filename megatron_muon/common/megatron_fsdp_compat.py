"""Recognising Megatron-FSDP modules, by ``isinstance``: the one place that knows their classes.

Megatron-FSDP exists twice in the supported stack: the ``megatron_fsdp`` package and the copy that
megatron-core vendors at ``megatron.core.distributed.fsdp.src.megatron_fsdp`` (megatron-core's
``FullyShardedDataParallel`` uses the vendored one). Their ``MegatronFSDP`` classes are different
objects, so a check must accept both, and megatron-core's ``FullyShardedDataParallel`` wrapper,
whose ``.module`` is the ``MegatronFSDP`` that drives the model chunk.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MEGATRON_FSDP_PACKAGES",
    "megatron_fsdp_classes",
    "megatron_fsdp_modules",
    "unwrap_megatron_fsdp",
    "uses_megatron_fsdp",
]

# The packages that define a ``MegatronFSDP`` class (either may be absent).
MEGATRON_FSDP_PACKAGES: tuple[str, ...] = (
    "megatron_fsdp",
    "megatron.core.distributed.fsdp.src.megatron_fsdp",
)


def megatron_fsdp_classes() -> tuple[type, ...]:
    """The ``MegatronFSDP`` classes that can be installed: megatron_fsdp's and megatron-core's."""
    classes = []
    for name in MEGATRON_FSDP_PACKAGES:
        try:
            classes.append(importlib.import_module(name).MegatronFSDP)
        except (ImportError, AttributeError):
            continue
    return tuple(classes)


def unwrap_megatron_fsdp(chunk: Any) -> Any | None:
    """The ``MegatronFSDP`` that drives ``chunk``, or None if ``chunk`` is not Megatron-FSDP.

    Accepts a ``MegatronFSDP`` (either copy) or megatron-core's ``FullyShardedDataParallel``.
    """
    from megatron.core.distributed import FullyShardedDataParallel

    classes = megatron_fsdp_classes()
    if isinstance(chunk, classes):
        return chunk
    if isinstance(chunk, FullyShardedDataParallel) and isinstance(chunk.module, classes):
        return chunk.module
    return None


def megatron_fsdp_modules(chunks: Sequence[Any]) -> list[Any]:
    """The ``MegatronFSDP`` of every model chunk, in order (the optimizer factory's input check).

    Raises:
        TypeError: a chunk is not wrapped by Megatron-FSDP, naming its index and class.
    """
    modules = []
    for index, chunk in enumerate(chunks):
        module = unwrap_megatron_fsdp(chunk)
        if module is None:
            raise TypeError(
                f"model chunk {index} ({type(chunk).__name__}) is not wrapped by Megatron-FSDP: "
                "build_muon_optimizer takes megatron.core.distributed.FullyShardedDataParallel or "
                "a MegatronFSDP (megatron_fsdp.fully_shard_model); for DDP or unwrapped models use "
                "megatron.core.optimizer.get_megatron_optimizer"
            )
        modules.append(module)
    return modules


def uses_megatron_fsdp(model_chunks: Sequence[Any] | Any) -> bool:
    """True when a chunk is wrapped by Megatron-FSDP (megatron-core's wrapper or either copy).

    ``model_chunks``: one module or a list/tuple of them, as ``get_megatron_optimizer`` takes them.
    """
    from megatron.core.distributed import FullyShardedDataParallel

    classes = (FullyShardedDataParallel, *megatron_fsdp_classes())
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return any(isinstance(chunk, classes) for chunk in chunks)

"""Uneven row chunks: DCP plans each rank's true rows of a Megatron-FSDP param and its state.

Megatron-FSDP shards each param by whole rows (``Shard(0)`` over the data-parallel mesh), unevenly
and often with empty shards (local shape ``(0, cols)``), while DTensor's own chunk metadata
assumes ``torch.chunk`` splits; under HSDP with outer ``optim`` sharding (placements ``(Shard(0),
Shard(0))``) rank order is not even row order. Before DCP plans a save or a load, each DTensor
gets its true chunk, as megatron_fsdp's ``preprocess_state_dict_for_uneven_dtensor`` does, but
computed from the param's ``megatron_fsdp_slice`` (``layout.fsdp_row_offset``) without
communication (megatron_fsdp's per-tensor ``all_gather_object`` dominated a demo model's save +
load time) and shared by the param and its state tensors; params without that attribute fall back
to megatron_fsdp's gather. So each rank writes exactly its own rows (nothing for an empty shard),
and a load at another data-parallel size or sharding strategy reads exactly the rows it now holds:
checkpoints reshard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron_muon.checkpointing.ranks import collective_device
from megatron_muon.engine.layout import fsdp_row_offset
from megatron_muon.engine.owner_state import is_owner_held

__all__ = ["attach_row_chunks"]


def _local_row_chunk(param: DTensor) -> ChunkStorageMetadata | None:
    """This rank's chunk of a Megatron-FSDP param, from local facts only; None if unknown here.

    Rows of a ``Shard(0)`` param start at ``layout.fsdp_row_offset`` (from the slice of the
    flattened param this rank holds; the only reliable offset under HSDP outer sharding, where
    rank order is not row order); an empty shard's chunk starts at row 0; a ``Replicate`` param's
    chunk is the whole tensor. Unknown (None): no ``megatron_fsdp_slice``, or one that does not
    cover whole rows of the local shard.
    """
    local = param.to_local()
    zeros = (0,) * local.ndim
    placements = param.placements
    if all(isinstance(p, Replicate) for p in placements):
        return ChunkStorageMetadata(offsets=torch.Size(zeros), sizes=local.shape)
    if not all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in placements
    ):
        return None
    try:
        offset = fsdp_row_offset(param)
    except ValueError:
        return None  # megatron_fsdp's gather decides
    if offset is None:
        return None
    offsets = (offset if local.numel() else 0, *zeros[1:])
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=local.shape)


def _attach_chunk(dtensor: DTensor, chunk: ChunkStorageMetadata) -> None:
    """Makes DCP plan ``dtensor`` as ``chunk`` (the true uneven rows), as megatron_fsdp's
    ``update_uneven_dtensor_chunk_metadata`` does, but with a chunk known without a collective.
    An empty shard writes nothing (and reads nothing: it overlaps no saved chunk)."""

    def write_items(fqn: str, tensor: DTensor) -> list[WriteItem]:
        local = tensor.to_local()
        if local.numel() == 0:
            return []
        return [
            WriteItem(
                type=WriteItemType.SHARD,
                index=MetadataIndex(fqn, chunk.offsets),
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(local),
                    size=tensor.size(),
                ),
            )
        ]

    # DTensor's checkpoint hooks (``__create_chunk_list__`` / ``__create_write_items__``) defer to
    # these attributes of its ``_local_tensor`` (DTensor's documented extension point for DCP, the
    # one megatron_fsdp uses). ``to_local()`` of an ``nn.Parameter`` DTensor returns a fresh view,
    # so the attributes must go on ``_local_tensor`` itself.
    local = dtensor._local_tensor
    # torch's stubs do not declare these hook attributes (set per tensor, read by getattr).
    local.__create_chunk_list__ = lambda: [chunk]  # type: ignore[attr-defined]  # see above
    local.__create_write_items__ = write_items  # type: ignore[attr-defined]  # see above


@torch.no_grad()
def attach_row_chunks(
    params: list[tuple[str, torch.Tensor]], optimizer_state: dict[str, dict[str, Any]]
) -> None:
    """Gives every DTensor param and its optimizer state its true uneven-row chunk metadata.

    Collective over the default process group. ``params``: (name, param) in the same order on
    every rank; ``optimizer_state``: name -> state dict (the tensors DCP saves or loads in place).
    A param and its state tensors (same local shape and placements) share one chunk; owner-held
    state (``engine.owner_state``) has its own: the whole tensor on its owner, nothing elsewhere.
    Chunks come from ``megatron_fsdp_slice`` without communication; params where some rank cannot
    tell (one ``all_reduce`` of flags decides, so every rank agrees) go through megatron_fsdp's
    ``gather_and_compute_chunk_metadata`` (one ``all_gather_object`` each, in name order).
    """
    from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata

    by_name = {name: param for name, param in params if isinstance(param, DTensor)}
    names = list(by_name)
    chunks = {name: _local_row_chunk(by_name[name]) for name in names}
    known = torch.tensor(
        [chunks[n] is not None for n in names], dtype=torch.int32, device=collective_device(None)
    )
    if dist.get_world_size() > 1:
        dist.all_reduce(known, op=dist.ReduceOp.MIN)
    for name, is_known in zip(names, known.tolist(), strict=True):
        param = by_name[name]
        chunk = chunks[name] if is_known else gather_and_compute_chunk_metadata(param)
        assert chunk is not None, name  # known on every rank (the all_reduce above)
        _attach_chunk(param, chunk)
        for value in optimizer_state.get(name, {}).values():
            if not isinstance(value, DTensor):
                continue
            if is_owner_held(value):  # whole on its owner at offset 0, nothing elsewhere
                local_shape = value.to_local().shape
                offsets = torch.Size((0,) * len(local_shape))
                _attach_chunk(value, ChunkStorageMetadata(offsets=offsets, sizes=local_shape))
                continue
            same = value.to_local().shape == param.to_local().shape
            if not (same and value.placements == param.placements):
                raise RuntimeError(
                    f"optimizer state of {name} is laid out unlike the param: local "
                    f"{tuple(value.to_local().shape)} {value.placements} vs "
                    f"{tuple(param.to_local().shape)} {param.placements}"
                )
            _attach_chunk(value, chunk)

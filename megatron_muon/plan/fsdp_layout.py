"""Rows of each Muon matrix held by each rank under Megatron-FSDP's flat-bucket sharding.

Megatron-FSDP puts each FSDP unit's (transformer layer's) params of one kind (dense or expert) in
one flat bucket, ordered by row size (``shape[1:].numel()``, largest first), padded to a multiple of
``group size x chunk_size_factor`` (the lcm of the row sizes), and gives each rank one contiguous
``size / group size`` slice: every cut falls between whole rows, most params lie on a run of ranks,
and shards are uneven and often empty. Item offsets come from
megatron_fsdp's own ``build_data_parallel_buffer_index``; the bucket grouping and the chunk size
factor mirror its ``_get_parameter_groups`` (step 3). Simplification: 1-D params of the layer (norm
weights, fused into TE linears) are left out of the bucket; they are fragments smaller than a chunk
and move the 2-D items' offsets by at most one chunk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from megatron_fsdp.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_fsdp.param_and_grad_buffer import build_data_parallel_buffer_index

from megatron_muon.plan.models import Matrix

__all__ = ["bucket_rows", "layout_rows"]

_SHARDED = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")


def _chunk_size_factor(shapes: Sequence[tuple[int, int]]) -> int:
    """megatron_fsdp's chunk size factor for a bucket whose shapes are sorted by row size."""
    factor = shapes[0][1]
    for rows, cols in shapes:
        numel = rows * cols
        fits = cols == factor or (factor % cols == 0 and numel % factor == 0) or numel < factor
        if not fits:
            factor = math.lcm(factor, cols)
    return factor


def bucket_rows(shapes: Sequence[tuple[int, int]], group_size: int) -> list[np.ndarray]:
    """Rows of each matrix of one bucket on each rank: ``result[i][r]``, int64 ``(group_size,)``.

    Args:
        shapes: ``(rows, cols)`` of the bucket's matrices, in param order.
        group_size: ranks the bucket is sharded over.
    """
    order = sorted(range(len(shapes)), key=lambda i: -shapes[i][1])  # stable, as sorted() there
    ordered = [shapes[i] for i in order]
    items, bucket, _ = build_data_parallel_buffer_index(
        [torch.Size(s) for s in ordered],
        0,
        group_size,
        True,
        _SHARDED,
        chunk_size_factor=_chunk_size_factor(ordered),
    )
    shard = bucket.size // group_size
    starts = np.arange(group_size, dtype=np.int64) * shard
    rows: list[np.ndarray] = [np.zeros(0)] * len(shapes)
    for item in items.values():
        index = order[item.item_id]
        cols = shapes[index][1]
        begin, end = item.global_data_index, item.global_data_index + item.size
        overlap = np.clip(np.minimum(starts + shard, end) - np.maximum(starts, begin), 0, None)
        assert not (overlap % cols).any(), "a shard cut falls inside a row"
        rows[index] = overlap // cols
        assert rows[index].sum() == shapes[index][0]
    return rows


def layout_rows(matrices: Sequence[Matrix], group_size: int) -> list[np.ndarray]:
    """Rows of each matrix on each rank, the matrices bucketed by their FSDP unit."""
    units: dict[int, list[int]] = {}
    for index, matrix in enumerate(matrices):
        units.setdefault(matrix.unit, []).append(index)
    rows: list[np.ndarray] = [np.zeros(0)] * len(matrices)
    for members in units.values():
        for index, held in zip(
            members, bucket_rows([matrices[i].shape for i in members], group_size), strict=True
        ):
            rows[index] = held
    return rows

"""QKV split: Newton-Schulz on Q, K and V of a fused ``linear_qkv`` weight apart.

megatron-core's ``linear_qkv`` weight (tensor-parallel-local) interleaves its rows per query
group: ``[q rows of group 0 (split_shapes[0]), k rows (split_shapes[1]), v rows (split_shapes[2]),
q rows of group 1, ...]``. With ``split_qkv``, ``TensorParallelMuon`` orthogonalizes Q, K and V
apart, each the ``(groups * s, cols)`` matrix of its rows from every group; ``ShardedMuon`` does
the same on the data-parallel-full matrix (or, for NS split over ranks by columns, on a column
block of it: the functions below take any number of columns).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["join_qkv", "qkv_pieces", "qkv_split_shapes", "split_qkv"]


def qkv_split_shapes(
    param: torch.Tensor,
    split_qkv: bool,
    is_qkv_fn: Callable[[torch.Tensor], bool] | None,
    default_shapes: Sequence[int] | None,
) -> tuple[int, ...]:
    """Rows per query group of Q, K and V of ``param``, or ``()`` when its NS is not split.

    ``param.qkv_split_shapes`` (set by megatron-core on the param) wins over ``default_shapes``
    (``TensorParallelMuon``'s ``qkv_split_shapes``).

    Raises:
        RuntimeError: ``param`` is a QKV weight to split but neither gives its split shapes.
    """
    if not (split_qkv and is_qkv_fn is not None and is_qkv_fn(param)):
        return ()
    shapes = getattr(param, "qkv_split_shapes", None) or default_shapes
    if shapes is None:
        raise RuntimeError("Muon QKV split requested but qkv_split_shapes is not set")
    return tuple(shapes)


def qkv_pieces(rows: int, cols: int, split_shapes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``(rows, cols)`` of the matrices NS runs on for a ``(rows, cols)`` matrix: Q, K and V under
    QKV split (``split_shapes`` non-empty and dividing ``rows``), else the matrix itself."""
    if not split_shapes or rows % sum(split_shapes) != 0:
        return ((rows, cols),)
    groups = rows // sum(split_shapes)
    return tuple((groups * size, cols) for size in split_shapes)


def split_qkv(matrix: torch.Tensor, split_shapes: Sequence[int]) -> list[torch.Tensor]:
    """Q, K and V of a 2-D ``(rows, cols)`` QKV matrix (or column block), each
    ``(groups * split_shapes[i], cols)``; the inverse of ``join_qkv``.

    Raises:
        RuntimeError: ``sum(split_shapes)`` does not divide ``rows``.
    """
    rows, cols = matrix.shape
    if rows % sum(split_shapes) != 0:
        raise RuntimeError(
            f"Muon QKV split shape mismatch: grad_shape={tuple(matrix.shape)}, "
            f"split_shapes={list(split_shapes)}"
        )
    groups = rows // sum(split_shapes)
    pieces = torch.split(matrix.view(groups, sum(split_shapes), cols), list(split_shapes), dim=1)
    return [piece.reshape(-1, cols) for piece in pieces]


def join_qkv(pieces: Sequence[torch.Tensor], split_shapes: Sequence[int]) -> torch.Tensor:
    """The ``(rows, cols)`` QKV matrix whose ``split_qkv`` is ``pieces``."""
    cols = pieces[0].shape[1]
    rows = sum(piece.shape[0] for piece in pieces)
    groups = rows // sum(split_shapes)
    return torch.cat([piece.view(groups, -1, cols) for piece in pieces], dim=1).view(rows, cols)

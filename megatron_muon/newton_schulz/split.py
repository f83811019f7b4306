"""Newton-Schulz of one matrix split over a small process group, exact to full-matrix NS.

When one matrix's NS is a large share of a step's work (a 14336x4096 MLP weight at DP 256), a
single owner leaves most ranks idle. This module runs the NS of one ``(rows, cols)`` matrix on ``g``
ranks, each holding a contiguous block of the matrix along its **long** dimension (the rows of a
tall matrix, the columns of a wide or square one: the dimension ``newton_schulz`` does not whiten
over), and returns each rank its block of the full-matrix result.

With ``X`` the ``(k, l)`` matrix NS works on (``k = min(rows, cols)``; the transpose of a tall
matrix, as ``newton_schulz`` takes it) and ``X_j`` rank ``j``'s ``(k, l_j)`` column block, one step
``X <- aX + (bA + cA^2) X`` with ``A = X X^T`` is:

1. ``A = sum_j X_j X_j^T``: a local ``(k, k)`` Gram matrix, all-reduced over the group (the Gram
   all-reduce form of emerging-optimizers' ``newton_schulz_tp(..., tp_mode="distributed")``);
2. ``B = bA + cA^2``: each rank computes its own block of ``B``'s rows (``2 k^3 / g`` FLOPs instead
   of ``2 k^3`` on every rank), then the row blocks are all-gathered;
3. ``X_j <- a X_j + B X_j``: local.

The normalization before the first step all-reduces the squared Frobenius norm. Per rank and step
that is ``4 k^2 l_j + 2 k_j k^2`` FLOPs (``ns_flops / g`` for even blocks) and two collectives of
``k^2`` elements (``cost_model.split_ns_flops`` / ``split_ns_bytes``). Same-shape matrices split
over one group can go in one batched call, sharing the collectives. Every rank of the group must
call with the same ``full_shape``; the blocks are those of ``cost_model.split_bounds(long side,
g)`` along ``cost_model.long_dim``. Under
``torch.get_float32_matmul_precision() == "medium"`` the iteration runs in bf16 exactly as
``newton_schulz`` does (collectives then carry bf16). Only the standard iteration is split (not
Gram NS): the ``"standard"`` entry of the NS-method registry is the splittable one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from emerging_optimizers.orthogonalized_optimizers.muon_utils import NSCoeffT

from megatron_muon.newton_schulz.cost_model import long_dim, split_bounds
from megatron_muon.newton_schulz.methods import NSConfig, coefficient_schedule

__all__ = ["split_newton_schulz", "split_scaled_orthogonalize"]


def split_newton_schulz(
    block: torch.Tensor,
    full_shape: tuple[int, int],
    group: dist.ProcessGroup | None,
    num_ns_steps: int,
    coefficient_type: NSCoeffT = "quintic",
    eps: float = 1e-7,
) -> torch.Tensor:
    """This rank's block of ``newton_schulz(full)``, computed from the blocks the group holds.

    Collective over ``group``: every rank of it calls with its own block, in the same order
    relative to any other collective on ``group``. Same-shape matrices split over the same group
    go in one call (a leading batch dim): one set of collectives for all of them.

    Args:
        block: fp32, plain tensor, 2-D or batched 3-D ``(B, ...)``. For a tall ``full_shape``
            (``rows > cols``) rows ``split_bounds(rows, g)[rank]`` of the full matrix, shape
            ``(rows_j, cols)``; otherwise columns ``split_bounds(cols, g)[rank]``, shape
            ``(rows, cols_j)``. May be empty.
        full_shape: ``(rows, cols)`` of the full matrix (each matrix of a batch), the same on every
            rank of ``group``.
        group: the ranks sharing this matrix (``None``: the default group).
        num_ns_steps: NS iterations.
        coefficient_type: emerging-optimizers' coefficient set name (not ``"custom"``).
        eps: floor of the Frobenius norm, as in ``newton_schulz``.

    Returns:
        fp32 tensor shaped like ``block``: the same rows (or columns) of ``newton_schulz(full)``.
    """
    if block.ndim not in (2, 3):
        raise ValueError(f"block must be 2-D or 3-D (batched), got shape {tuple(block.shape)}")
    if block.dtype != torch.float32:
        raise ValueError(f"block must be float32, got {block.dtype}")
    rows, cols = full_shape
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    dim = long_dim(rows, cols)
    start, stop = split_bounds(full_shape[dim], size)[rank]
    expected = (stop - start, cols) if dim == 0 else (rows, stop - start)
    if tuple(block.shape[-2:]) != expected:
        raise ValueError(
            f"rank {rank} of {size} must hold block {expected} of {tuple(full_shape)} "
            f"(split along dim {dim}), got {tuple(block.shape)}"
        )
    k = min(rows, cols)
    x = block.mT if dim == 0 else block  # (..., k, l_j): the long side is split

    norm_sq = (x * x).sum(dim=(-2, -1), keepdim=True)
    dist.all_reduce(norm_sq, group=group)
    x = x / torch.sqrt(norm_sq).clamp_min(eps)
    if torch.get_float32_matmul_precision() == "medium":
        x = x.to(torch.bfloat16)  # as newton_schulz: bf16 iteration under "medium" precision

    k_bounds = split_bounds(k, size)
    k_start, k_stop = k_bounds[rank]
    pad_rows = max(b - a for a, b in k_bounds)
    addmm = torch.addmm if x.ndim == 2 else torch.baddbmm
    for a, b, c in coefficient_schedule(num_ns_steps, coefficient_type):
        gram = x @ x.mT
        dist.all_reduce(gram, group=group)
        own = gram[..., k_start:k_stop, :]
        b_rows = gram.new_zeros(*gram.shape[:-2], pad_rows, k)
        b_rows[..., : k_stop - k_start, :] = addmm(own, own, gram, alpha=c, beta=b)
        gathered = [torch.empty_like(b_rows) for _ in range(size)]
        dist.all_gather(gathered, b_rows, group=group)
        pieces = [g[..., : hi - lo, :] for g, (lo, hi) in zip(gathered, k_bounds, strict=True)]
        x = addmm(x, torch.cat(pieces, dim=-2), x, alpha=1.0, beta=a)
    x = x.to(torch.float32)
    return x.mT if dim == 0 else x


def split_scaled_orthogonalize(
    block: torch.Tensor,
    full_shape: tuple[int, int],
    group: dist.ProcessGroup | None,
    config: NSConfig,
) -> torch.Tensor:
    """``split_newton_schulz`` times Muon's scale of the full shape, as ``scaled_orthogonalize``.

    ``block`` may be batched ``(B, ...)``: same-shape matrices split over the same group.
    """
    orthogonal = split_newton_schulz(
        block, full_shape, group, config.num_ns_steps, config.coefficient_type
    )
    return orthogonal * config.shape_scale(*full_shape) * config.extra_scale_factor

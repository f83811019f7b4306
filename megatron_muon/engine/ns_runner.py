"""This rank's Newton-Schulz work in one step, with ``TensorParallelMuon``'s rules.

``NSRunner`` orthogonalizes what the exchange brought to this rank (``owner_pipeline``): whole
matrices (data-parallel-full, tensor-parallel-local, ``(rows, cols)`` fp32), the blocks of matrices
whose NS is split over a block of ranks (``split_newton_schulz``), and local expert tensors
``(E, out, in)`` (whole experts per rank). It applies Muon's scale as ``TensorParallelMuon`` does,
runs Q, K and V apart under QKV split (``qkv``), batches small same-shape NS jobs into one call,
and counts the FLOPs it runs into the step's ``StepStats``. A matrix whose NS is
``TensorParallelMuon``'s (``NSMatrix.stock_ns``: with tensor-parallel collectives, or the unsplit
matrix of tp_mode ``layer_sharded``) goes whole through the optimizer's ``tensor_parallel``
callable, unless its NS is split (layer_sharded, above the split threshold): then its blocks run
``split_newton_schulz`` as any split matrix's.

Batching same-shape jobs into one NS call saves per-call overhead but costs a stacking copy of the
inputs; on one CPU thread it pays only for small matrices (``batch_pays``), so larger ones run one
by one, each with no copy at all. Every NS call runs inside the profiler scope ``NS_SCOPE``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_muon.engine.exchange import ExchangeStats
from megatron_muon.engine.qkv import join_qkv, split_qkv
from megatron_muon.engine.step_plan import MatrixPlan, NSMatrix
from megatron_muon.engine.tp_grid import join_partitions, stack_partitions
from megatron_muon.newton_schulz.cost_model import split_ns_flops
from megatron_muon.newton_schulz.methods import NSConfig, orthogonalize_batch
from megatron_muon.newton_schulz.split import split_scaled_orthogonalize

__all__ = ["NS_SCOPE", "NSRunner", "StepStats", "batch_pays"]

# Profiler scope (``torch.profiler.record_function``) of every Newton-Schulz call of a step.
NS_SCOPE = "megatron_muon.newton_schulz.methods"

# Largest matrix (elements) whose same-shape NS jobs are batched on CPU: measured on one thread
# (benchmarks.ns_batching, docs/benchmarks.md), batching pays 1.3-3x up to (128, 512), is even
# (0.97-1.01) at 512 x 256 elements, and costs about 3% from (512, 512) up (the stacking copy).
CPU_BATCH_MAX_NUMEL = 512 * 256


def batch_pays(shape: tuple[int, int], device: torch.device) -> bool:
    """Whether same-shape NS jobs of ``shape`` run faster batched into one call on ``device``.

    CPU: up to ``CPU_BATCH_MAX_NUMEL`` elements. GPUs: always (not measured here; batching keeps
    the GPU busy with fewer, larger kernels).
    """
    return device.type != "cpu" or shape[0] * shape[1] <= CPU_BATCH_MAX_NUMEL


@dataclass(slots=True)
class StepStats(ExchangeStats):
    """What the last ``step()`` cost this rank: NS FLOPs, bytes moved, collectives entered, and
    the largest fp32 bytes of full matrices (or work blocks) held at once."""

    ns_flops: int = 0
    peak_full_matrix_bytes: int = 0

    def note_held(self, matrices: Sequence[torch.Tensor]) -> None:
        """Records fp32 ``matrices`` held at once (for ``peak_full_matrix_bytes``)."""
        total = sum(4 * m.numel() for m in matrices)
        self.peak_full_matrix_bytes = max(self.peak_full_matrix_bytes, total)


@dataclass(slots=True)
class NSRunner:
    """Runs this rank's NS work of one step.

    Attributes:
        config: NS method, coefficients and Muon's scale.
        stats: the step's figures; NS FLOPs are added to it.
        tensor_parallel: NS (with scale) of a whole ``stock_ns`` matrix, through
            ``TensorParallelMuon``'s NS; counts its own FLOPs.
        finish: the optimizer's per-matrix function after NS, on the rank that orthogonalized
            the whole matrix (``(rows, cols)`` fp32 in and out); None: NS's result is the update
            (Muon). Not applied to split blocks or expert tensors.
    """

    config: NSConfig
    stats: StepStats
    tensor_parallel: Callable[[NSMatrix, torch.Tensor], torch.Tensor]
    finish: Callable[[NSMatrix, torch.Tensor], torch.Tensor] | None = None

    def whole(
        self, matrices: Sequence[MatrixPlan], tensors: list[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        """Orthogonalized ``tensors``, in order (``each_whole`` collected)."""
        results = dict(self.each_whole(matrices, tensors))
        return [results[i] for i in range(len(tensors))]

    def each_whole(
        self, matrices: Sequence[MatrixPlan], tensors: list[torch.Tensor | None]
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """``(i, orthogonalized tensors[i])`` for the full ``(rows, cols)`` fp32 matrices of
        ``matrices``, each yielded as soon as it is done.

        Releases each input (``tensors[i] = None``) once its NS ran, so that an input nobody else
        holds is freed before the next NS starts. ``stock_ns`` matrices go
        through ``tensor_parallel`` first, one by one, in order (the TP ranks call in the same
        order); all others are cut into NS jobs (Q, K and V apart under QKV split): jobs of one
        shape where ``batch_pays`` share one NS call, the others run one by one, matrix by matrix.
        """
        jobs: dict[int, list[torch.Tensor]] = {}
        for i, plan in enumerate(matrices):
            if plan.matrix.stock_ns:
                with torch.profiler.record_function(NS_SCOPE):
                    result = self.tensor_parallel(plan.matrix, _take(tensors, i))
                yield i, self._finish(plan.matrix, result)
            elif plan.matrix.qkv_split_shapes:
                jobs[i] = split_qkv(_take(tensors, i), plan.matrix.qkv_split_shapes)
            else:
                jobs[i] = [_take(tensors, i)]
        small = [
            (i, p) for i, pieces in jobs.items() for p, job in enumerate(pieces) if _batched(job)
        ]
        done = dict(zip(small, self.jobs([jobs[i][p] for i, p in small]), strict=True))
        for i, pieces in jobs.items():
            outputs = [
                done.pop((i, p)) if (i, p) in done else self.jobs([job])[0]
                for p, job in enumerate(pieces)
            ]
            pieces.clear()
            shapes = matrices[i].matrix.qkv_split_shapes
            result = join_qkv(outputs, shapes) if len(outputs) > 1 else outputs[0]
            yield i, self._finish(matrices[i].matrix, result)

    def _finish(self, matrix: NSMatrix, result: torch.Tensor) -> torch.Tensor:
        return result if self.finish is None else self.finish(matrix, result)

    def split_block(
        self, plan: MatrixPlan, block: torch.Tensor, group: dist.ProcessGroup, part: int
    ) -> torch.Tensor:
        """This rank's block of a matrix whose NS is split over ``group`` (Q, K, V apart).

        Collective over ``group``. ``block`` holds rows (tall matrix) or columns (wide matrix, or
        a QKV param split by columns) ``split_bounds(long side, g)[part]`` of the matrix NS runs
        on (``ns_shape``); for a row-parallel stacked matrix (layer_sharded), those columns as
        the rectangle of the stacked partitions that holds them (``tp_grid``), joined here.
        """
        matrix = plan.matrix
        rows, cols = matrix.ns_shape
        count = 1
        if matrix.row_parallel:  # the rectangle's partitions side by side: columns of ns_shape
            count = block.shape[0] * matrix.tp_partitions // matrix.shape[0]
            block = join_partitions(block, count, 1)
        pieces = matrix.pieces
        for piece_rows, piece_cols in pieces:
            self.stats.ns_flops += split_ns_flops(
                piece_rows, piece_cols, self.config.num_ns_steps, plan.split_size, part
            )
        with torch.profiler.record_function(NS_SCOPE):
            if len(pieces) == 1:
                result = split_scaled_orthogonalize(block, (rows, cols), group, self.config)
            else:
                shapes = matrix.qkv_split_shapes
                done = [
                    split_scaled_orthogonalize(piece, (piece_rows, cols), group, self.config)
                    for piece, (piece_rows, _) in zip(split_qkv(block, shapes), pieces, strict=True)
                ]
                result = join_qkv(done, shapes)
        return stack_partitions(result, count, 1)

    def experts(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Orthogonalized local expert tensors ``(E, out, in)`` fp32, each expert on its own (all
        experts of all tensors in one set of batched NS calls); no communication."""
        results = iter(self.jobs([expert for tensor in tensors for expert in tensor.unbind(0)]))
        out = []
        for tensor in tensors:
            local = [next(results) for _ in range(tensor.shape[0])]
            out.append(
                torch.stack(local) if local else torch.empty(tensor.shape, device=tensor.device)
            )
        return out

    def jobs(self, jobs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """NS + scale of each 2-D job, same-shape jobs batched into one call; order kept."""
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for index, job in enumerate(jobs):
            by_shape.setdefault(tuple(job.shape), []).append(index)
        results: dict[int, torch.Tensor] = {}
        for (rows, cols), indices in by_shape.items():
            with torch.profiler.record_function(NS_SCOPE):
                outputs = orthogonalize_batch([jobs[i] for i in indices], self.config)
            self.stats.ns_flops += len(indices) * self.config.flops(rows, cols)
            results.update(zip(indices, outputs, strict=True))
        return [results[i] for i in range(len(jobs))]


def _batched(job: torch.Tensor) -> bool:
    return batch_pays((job.shape[0], job.shape[1]), job.device)


def _take(tensors: list[torch.Tensor | None], i: int) -> torch.Tensor:
    """``tensors[i]``, released from the list."""
    tensor = tensors[i]
    tensors[i] = None
    assert tensor is not None
    return tensor

"""Muon under tensor parallelism: ``--muon-tp-mode`` blockwise, duplicated and layer_sharded.

At TP = 2 x DP = 2 (4 ranks) on the dense model's weights (``BenchConfig.dense``), one
``ShardedMuon`` per tp_mode on the same params, stepped in turn: each step's median time, and,
counted while one more step runs (``benchmarks.step_counts``), the matmul FLOPs (NS) and the bytes
handed to collectives of the busiest rank. ``duplicated`` runs each unsplit matrix's NS on every
TP rank; ``layer_sharded`` runs it once over the DP x TP grid (the same update, bitwise);
``blockwise`` orthogonalizes each TP partition on its own (not Muon's update: the cheap baseline).
Targets (issue 38): layer_sharded's busiest-rank NS FLOPs <= 0.55x duplicated's, its step time
<= 0.7x.

The params are laid out as Megatron-FSDP lays out TP weights (``tensor_parallel_params``): a
DTensor on the ``(dp_cp, tp)`` mesh per weight, placements ``(Shard(0), Shard(partition_dim))``,
the unsplit global shape, ``partition_dim`` 0 for column-parallel (QKV, fc1) and 1 for row-parallel
(proj, fc2) weights, each TP partition's rows split evenly over the DP ranks
(``megatron_fsdp_slice`` set).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from benchmarks.launcher import run_ranks
from benchmarks.models import TransformerShapes
from benchmarks.optimizer_step import MUON_KWARGS
from benchmarks.section import RunContext, Section

__all__ = ["SECTION", "TP_MODES", "tensor_parallel_params", "tp_modes_section"]

TP_MODES = ("blockwise", "duplicated", "layer_sharded")
TP, DP = 2, 2
FLOPS_TARGET = 0.55  # layer_sharded / duplicated, busiest rank's NS FLOPs
TIME_TARGET = 0.7  # layer_sharded / duplicated, step time
# Megatron's TP split of each weight of ``TransformerShapes.layer_shapes`` (dense): QKV and fc1
# column-parallel (rows), proj and fc2 row-parallel (columns).
_PARTITION_DIMS = (0, 1, 0, 1)


def tensor_parallel_params(shapes: TransformerShapes, mesh, device: str) -> list[torch.Tensor]:
    """The dense model's weights as TP x DP DTensors (module docstring), with random row grads.

    Args:
        mesh: a 2-D ``(dp_cp, tp)`` device mesh.
    """
    tp_index, dp_index = mesh.get_local_rank("tp"), mesh.get_local_rank("dp_cp")
    weights = torch.Generator().manual_seed(0)
    grads = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    params = []
    for k, shape in enumerate(shapes.shapes()):
        dim = _PARTITION_DIMS[k % len(_PARTITION_DIMS)]
        full = torch.randn(*shape, generator=weights) / shape[1] ** 0.5
        partition = full.chunk(mesh.size(1), dim=dim)[tp_index]
        bounds = torch.arange(partition.shape[0]).tensor_split(mesh.size(0))[dp_index]
        start, stop = (int(bounds[0]), int(bounds[-1]) + 1) if len(bounds) else (0, 0)
        local = partition[start:stop].contiguous().to(device)
        param = torch.nn.Parameter(_unsplit_dtensor(local, mesh, dim, full))
        param.partition_dim = dim  # type: ignore[attr-defined]  # Megatron's TP attribute
        cols = partition.shape[1]
        param.megatron_fsdp_slice = slice(start * cols, stop * cols)  # type: ignore[attr-defined]
        grad = torch.randn(local.shape, generator=grads).to(device)
        param.grad = _unsplit_dtensor(grad, mesh, dim, full)
        params.append(param)
    return params


def _unsplit_dtensor(local: torch.Tensor, mesh, dim: int, full: torch.Tensor) -> torch.Tensor:
    """``local`` rows of a TP partition as a DTensor of the unsplit ``full``'s shape."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(
        local, mesh, [Shard(0), Shard(dim)], run_check=False, shape=full.shape, stride=full.stride()
    )


def tp_mode_steps(
    rank: int, world_size: int, device: str, shapes: TransformerShapes, warmup: int, repeats: int
) -> dict:
    """One rank's ``ShardedMuon`` in each tp_mode on the same TP x DP params (rank body).

    Returns:
        ``benchmarks.step_counts.step_figures`` by tp_mode.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.step_counts import step_figures
    from megatron_muon import ShardedMuon

    mesh = init_device_mesh(device, (DP, TP), mesh_dim_names=("dp_cp", "tp"))
    params = tensor_parallel_params(shapes, mesh, device)
    # What ShardedMuon (and TensorParallelMuon under it) reads of megatron-core's collection.
    groups = SimpleNamespace(
        tp=mesh.get_group("tp"), expt_tp=None, gtp_remat=None, expt_gtp_remat=None
    )
    kwargs = {k: v for k, v in MUON_KWARGS.items() if k != "tp_mode"}
    optimizers = {
        mode: ShardedMuon.from_keywords(
            params, dp_group=mesh.get_group("dp_cp"), pg_collection=groups, tp_mode=mode, **kwargs
        )
        for mode in TP_MODES
    }
    return step_figures(optimizers, device, warmup, repeats)


def tp_modes_section(shapes: TransformerShapes, device: str, warmup: int, repeats: int) -> dict:
    """Every tp_mode's figures at TP x DP (rank 0's view of the max over ranks), and the ratios
    the targets read."""
    figures = run_ranks(tp_mode_steps, TP * DP, device, shapes, warmup, repeats)[0]
    by_mode = {
        mode: {
            "seconds": f["seconds"],
            "ns_flops_max": f["flops"]["max"],
            "collective_bytes_max": f["collective_bytes"]["max"],
            "transient_bytes": f["transient_bytes"],
        }
        for mode, f in figures.items()
    }
    layer, duplicated = by_mode["layer_sharded"], by_mode["duplicated"]
    return {
        "tp": TP,
        "dp": DP,
        "model": shapes.describe(),
        "by_mode": by_mode,
        "layer_sharded_over_duplicated_flops": layer["ns_flops_max"] / duplicated["ns_flops_max"],
        "layer_sharded_over_duplicated_s": layer["seconds"] / duplicated["seconds"],
        "targets": {"flops": FLOPS_TARGET, "seconds": TIME_TARGET},
    }


def format_tp_modes(section: dict) -> list[str]:
    """The section as Markdown lines."""
    lines = [
        f"**Tensor parallelism** (TP={section['tp']} x DP={section['dp']}, {section['model']}; "
        "stepped in turn; busiest rank's counts)",
        "",
        "| --muon-tp-mode | step s | NS GFLOP | collective MiB |",
        "| --- | --- | --- | --- |",
    ]
    for mode, e in section["by_mode"].items():
        lines.append(
            f"| {mode} | {e['seconds']:.3f} | {e['ns_flops_max'] / 1e9:.2f} | "
            f"{e['collective_bytes_max'] / 2**20:.1f} |"
        )
    flops, seconds = (
        section["layer_sharded_over_duplicated_flops"],
        section["layer_sharded_over_duplicated_s"],
    )
    targets = section["targets"]
    lines += [
        "",
        f"layer_sharded / duplicated: NS FLOPs {flops:.2f} (target <= {targets['flops']}), "
        f"step time {seconds:.2f} (target <= {targets['seconds']}).",
    ]
    return lines


def _run(context: RunContext, results: dict) -> dict:
    config = context.config
    return tp_modes_section(config.dense, context.device, config.warmup, config.repeats)


def _lines(results: dict) -> list[str]:
    return [*format_tp_modes(results["tp_modes"]), ""]


SECTION = Section(
    key="tp_modes",
    run=_run,
    figures=(
        "tp_modes.by_mode.*.seconds",
        "tp_modes.layer_sharded_over_duplicated_flops",
        "tp_modes.layer_sharded_over_duplicated_s",
    ),
    report=_lines,
    markdown=_lines,
)

"""Each orthogonalized optimizer of emerging-optimizers, on row shards, equals its class on full
matrices.

polargrad, scion, mop, spel, muon_hyperball (with and without ``hyperball_radius``) and
sinkhorn_muon: each rank steps a row-sharded copy (uneven and empty shards; a rank with no rows has
``grad is None``) through its adapter (``optimizers.orthogonalized_adapters``) and the
emerging-optimizers class on the full params side by side, two steps with fresh grads, owner mode
(and gather mode at DP 2; MuonHyperball and SinkhornMuon also on params replicated over the group,
where sums must count each row once), fp32 with highest matmul precision on both sides. One launch
per DP size (2, 3, 4) steps them all; DP 1 runs in this process without torch.distributed.
Params and momentum: relative error (Frobenius, per matrix) <= ``TOLERANCE`` (1e-6): the
orthogonalization runs on the same full fp32 matrix as the reference's (bitwise the same input;
measured: 0 error but for muon_hyperball); only MuonHyperball's weight norms are sums over shards,
which round differently from a norm in one process (~1e-7).
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.muon_reference import TOLERANCE, full_tensor
from tests.row_split_parity import offsets, set_sharded_grad, sharded_param

SHAPES = [(48, 16), (16, 48), (33, 7)]
STEPS = 2
_COMMON = dict(lr=0.05, momentum=0.9, fp32_matmul_prec="highest")
_DECAY = dict(_COMMON, weight_decay=0.05, nesterov=True)
# case -> (registry name, the class's keywords): settings that are not the defaults where one
# matters (a scale, Nesterov, a weight-decay method, the hyperball radius).
CASES: dict[str, tuple[str, dict]] = {
    "polargrad": ("polargrad", dict(_DECAY, weight_decay_method="l2", extra_scale_factor=0.5)),
    "scion": ("scion", dict(_COMMON, spectral_radius=2.0)),
    "mop": ("mop", dict(_DECAY)),
    "spel": ("spel", dict(_DECAY, weight_decay_method="independent", num_ns_steps=6)),
    "muon_hyperball": ("muon_hyperball", dict(_DECAY, scale_mode="shape_scaling")),
    "muon_hyperball radius": ("muon_hyperball", dict(_DECAY, hyperball_radius=3.0)),
    "sinkhorn_muon": ("sinkhorn_muon", dict(_DECAY, num_iters=5)),
}


def _splits(world_size: int) -> list[list[int]]:
    """Uneven row splits; with 3+ ranks the middle ranks hold nothing of the first matrix."""
    splits = []
    for index, (rows, _) in enumerate(SHAPES):
        if index == 0 and world_size > 2:
            parts = [0] * world_size
            parts[0], parts[-1] = rows // 3, rows - rows // 3
        else:
            weights = [r + 1 for r in range(world_size)]
            parts = [rows * w // sum(weights) for w in weights]
            parts[-1] += rows - sum(parts)
        splits.append(parts)
    return splits


def _initial(name: str) -> list[torch.Tensor]:
    """The full initial weights (Sinkhorn-normalized for sinkhorn_muon, as its class requires)."""
    from emerging_optimizers.utils.sinkhorn_mapper import SinkhornMapper

    fulls = [full_tensor(shape, seed=i) for i, shape in enumerate(SHAPES)]
    return [SinkhornMapper()(f) for f in fulls] if name == "sinkhorn_muon" else fulls


def _step_both(params, optimizer, reference_params, reference, splits, rank) -> None:
    for step in range(STEPS):
        for i, (p, ref) in enumerate(zip(params, reference_params, strict=True)):
            grad = full_tensor(ref.shape, seed=1000 * step + i + 100)
            ref.grad = grad.clone()
            if splits is None:
                p.grad = grad.clone()
            else:
                set_sharded_grad(p, grad, splits[i], rank, none_if_empty=True)
        optimizer.step()
        reference.step()


def _errors(params, optimizer, reference_params, reference, starts) -> dict[str, float]:
    """Worst relative error of this rank's rows of the params and momenta."""
    from megatron_muon.engine.layout import local_tensor

    worst = {"param": 0.0, "momentum": 0.0}
    for p, ref, start in zip(params, reference_params, starts, strict=True):
        local = local_tensor(p.detach())
        rows = slice(start, start + local.shape[0])
        for key, mine, full in (
            ("param", local, ref.detach()),
            (
                "momentum",
                local_tensor(optimizer.state[p]["momentum_buffer"]),
                reference.state[ref]["momentum_buffer"],
            ),
        ):
            error = ((mine - full[rows]).norm() / full.norm()).item()
            worst[key] = max(worst[key], error)
    return worst


def _case(
    case: str, rank: int, world_size: int, mode: str, replicated: bool = False
) -> dict[str, float]:
    """``replicated``: every rank holds the whole params (plain tensors replicated over the
    group, as under ``no_shard``): sums over the group count each row once."""
    from emerging_optimizers import registry

    from megatron_muon.optimizers.adaptive_muon import MuonFsdpConfig
    from megatron_muon.optimizers.orthogonalized_adapters import SHARDED_ORTHOGONALIZED

    name, keywords = CASES[case]
    fulls = _initial(name)
    reference_params = [torch.nn.Parameter(f.clone()) for f in fulls]
    reference = registry.get_optimizer_cls(name)(reference_params, **keywords)
    if world_size == 1 or replicated:
        splits, starts = None, [0] * len(fulls)
        params = [torch.nn.Parameter(f.clone()) for f in fulls]
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))
        splits = _splits(world_size)
        starts = [offsets(rows)[rank] for rows in splits]
        params = [sharded_param(f, r, rank, mesh) for f, r in zip(fulls, splits, strict=True)]
    optimizer = SHARDED_ORTHOGONALIZED[name](params, fsdp=MuonFsdpConfig(mode=mode), **keywords)
    _step_both(params, optimizer, reference_params, reference, splits, rank)
    return _errors(params, optimizer, reference_params, reference, starts)


def _run(rank: int, world_size: int) -> dict:
    torch.set_float32_matmul_precision("highest")
    # Gather mode (the reference placement, no owner exchange) at DP 2 only.
    modes = ("owner", "gather") if world_size == 2 else ("owner",)
    results: dict = {
        (case, mode): _case(case, rank, world_size, mode) for case in CASES for mode in modes
    }
    for case in ("muon_hyperball", "sinkhorn_muon"):  # norms and column sums over the group
        results[(case, "replicated")] = _case(case, rank, world_size, "owner", replicated=True)
    results["tensor-parallel refusal"] = _tensor_parallel_refusal()
    return results


def _tensor_parallel_refusal() -> str:
    """The error for params whose tensor-parallel group (here: all ranks) has several ranks."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_muon.optimizers.orthogonalized_adapters import ShardedScion

    tp = SimpleNamespace(tp=dist.group.WORLD, expt_tp=dist.group.WORLD)
    try:
        ShardedScion([torch.nn.Parameter(torch.ones(4, 4))], pg_collection=tp)
    except ValueError as error:
        return str(error)
    return "not refused"


@pytest.mark.parametrize("case", CASES)
def test_one_rank_without_torch_distributed_equals_the_class(case: str) -> None:
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        errors = _case(case, 0, 1, "owner")
    finally:
        torch.set_float32_matmul_precision(previous)
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_row_shards_equal_the_class_on_full_matrices(world_size: int) -> None:
    results = run_on_ranks(_run, world_size)
    for rank, by_case in enumerate(results):
        refusal = by_case.pop("tensor-parallel refusal")
        assert f"tensor-parallel size 1 only, got size {world_size}" in refusal, refusal
        for case, errors in by_case.items():
            assert max(errors.values()) <= TOLERANCE, (rank, case, errors)

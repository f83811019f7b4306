"""LaProp, ObliqueSGD and ObliqueAdam on row shards equal their emerging-optimizers classes on
full matrices.

Each rank steps a row-sharded copy (uneven shards; at DP 3 the middle rank holds no rows of the
first matrix and has ``grad is None`` there) through ``ShardedLaProp`` / ``ShardedObliqueSGD`` /
``ShardedObliqueAdam`` and the emerging-optimizers class on the full fp32 params side by side,
three steps with fresh grads; the oblique classes also on params every rank holds whole
(replicated, as under ``no_shard``: column sums must count each row once). One launch at DP 3
steps every case; DP 1 runs in this process without torch.distributed.

Tolerances: the state (moments, momentum, step) is elementwise, so bitwise everywhere; the params
are bitwise where the math is per element or per row (LaProp; ``dim=1``). Over ``dim=0`` each
column's inner product and norm is a sum of per-rank partial sums (an all_reduce) where the class
sums the column at once: fp32 reduction order, relative Frobenius error <= ``COLUMN_TOLERANCE``
(measured: 9.0e-8 at DP 3; not 0 in one process either, where ``sqrt(sum(x^2))`` replaces
``x.norm()``).
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.muon_reference import full_tensor
from tests.row_split_parity import offsets, set_sharded_grad, sharded_param

SHAPES = [(30, 12), (12, 30), (33, 7)]
STEPS = 3
COLUMN_TOLERANCE = 1e-6
_COMMON = dict(lr=0.05, weight_decay=0.05)
# case -> (registry name, the class's keywords): each non-default setting somewhere.
CASES: dict[str, tuple[str, dict]] = {
    "laprop": ("laprop", dict(_COMMON, betas=(0.9, 0.95))),
    "laprop l2": ("laprop", dict(_COMMON, weight_decay_method="l2", correct_bias=False)),
    "oblique_sgd columns": ("oblique_sgd", dict(_COMMON, momentum=0.8)),
    "oblique_sgd rows": ("oblique_sgd", dict(_COMMON, dim=1, weight_decay_method="independent")),
    "oblique_adam columns": ("oblique_adam", dict(_COMMON, betas=(0.8, 0.9))),
    "oblique_adam rows": ("oblique_adam", dict(_COMMON, dim=1, correct_bias=False)),
}


def _bitwise(case: str) -> bool:
    """Whether the params equal the class's bit for bit (no sum over a column)."""
    name, keywords = CASES[case]
    return name == "laprop" or keywords.get("dim") == 1


def _splits(world_size: int) -> list[list[int]]:
    """Uneven row splits; with 3+ ranks the middle ranks hold nothing of the first matrix."""
    splits = []
    for index, (rows, _) in enumerate(SHAPES):
        weights = [r + 1 for r in range(world_size)]
        parts = [rows * w // sum(weights) for w in weights]
        if index == 0 and world_size > 2:
            parts = [rows // 3] + [0] * (world_size - 2) + [rows - rows // 3]
        parts[-1] += rows - sum(parts)
        splits.append(parts)
    return splits


def _initial(name: str, keywords: dict) -> list[torch.Tensor]:
    """Full initial weights, on the manifold for the oblique classes (unit rows or columns)."""
    fulls = [full_tensor(shape, seed=i) for i, shape in enumerate(SHAPES)]
    if name == "laprop":
        return fulls
    return [torch.nn.functional.normalize(f, dim=keywords.get("dim", 0)) for f in fulls]


def _case(case: str, rank: int, world_size: int, replicated: bool = False) -> dict:
    """Worst relative errors of this rank's rows (params; each state tensor) and the step
    counts, after ``STEPS`` steps of ours and the class on the same grads."""
    from emerging_optimizers import registry

    from megatron_muon.engine.layout import local_tensor
    from megatron_muon.fsdp.rowwise_optimizers import ROWWISE_OPTIMIZERS

    name, keywords = CASES[case]
    fulls = _initial(name, keywords)
    reference_params = [torch.nn.Parameter(f.clone()) for f in fulls]
    reference = registry.get_optimizer_cls(name)(reference_params, **keywords)
    splits, starts = None, [0] * len(fulls)
    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    if world_size > 1 and not replicated:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))
        splits = _splits(world_size)
        starts = [offsets(rows)[rank] for rows in splits]
        params = [sharded_param(f, r, rank, mesh) for f, r in zip(fulls, splits, strict=True)]
    optimizer = ROWWISE_OPTIMIZERS[name](params, **keywords)
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
    errors: dict[str, float] = {}
    for p, ref, start in zip(params, reference_params, starts, strict=True):
        rows = slice(start, start + local_tensor(p).shape[0])
        pairs = {"param": (local_tensor(p.detach()), ref.detach())}
        for key, value in reference.state[ref].items():
            mine = optimizer.state[p][key]
            if key == "step":
                errors["step"] = max(errors.get("step", 0.0), float(mine != value))
                continue
            pairs[key] = (local_tensor(mine), value)
        for key, (mine, full) in pairs.items():
            error = ((mine - full[rows]).norm() / full.norm()).item()
            errors[key] = max(errors.get(key, 0.0), error)
    return errors


def _run(rank: int, world_size: int) -> dict:
    results = {(case, "sharded"): _case(case, rank, world_size) for case in CASES}
    for case in ("oblique_sgd columns", "oblique_adam columns"):  # column sums count rows once
        results[(case, "replicated")] = _case(case, rank, world_size, replicated=True)
    return results


def _assert_equal_to_the_class(case: str, errors: dict[str, float], where: object) -> None:
    state = {key: error for key, error in errors.items() if key != "param"}
    assert not any(state.values()), (where, case, errors)  # elementwise: bitwise
    if _bitwise(case):
        assert errors["param"] == 0, (where, case, errors)
    else:
        assert errors["param"] <= COLUMN_TOLERANCE, (where, case, errors)


@pytest.mark.parametrize("case", CASES)
def test_one_rank_without_torch_distributed_equals_the_class(case: str) -> None:
    _assert_equal_to_the_class(case, _case(case, 0, 1), "DP 1")


@pytest.mark.multirank
def test_uneven_and_empty_row_shards_equal_the_class_on_full_matrices() -> None:
    results = run_on_ranks(_run, 3, timeout=300)  # torch.compile of LaProp on 2 shared cores
    for rank, by_case in enumerate(results):
        for (case, layout), errors in by_case.items():
            _assert_equal_to_the_class(case, errors, (rank, layout))
    worst = max(e["param"] for by_case in results for e in by_case.values())
    print(f"\nlargest param error (dim=0 column sums): {worst:.2e}")

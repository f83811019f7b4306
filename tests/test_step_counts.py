"""The bench's per-step counts (``benchmarks.step_counts``) on 2 gloo ranks: matmul FLOPs and the
bytes each rank hands to collectives, for c10d calls and DTensor's functional collectives alike,
and under a ``torch.compile``'d function (run eagerly while counted)."""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def _count(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from benchmarks.step_counts import count_step, max_and_mean

    mesh = init_device_mesh("cpu", (world_size,))
    shard = DTensor.from_local(torch.ones(10, 4), mesh, [Shard(0)], run_check=False)
    vector = torch.ones(1000)
    square = torch.compile(lambda a: a @ a, fullgraph=True)

    def step() -> None:
        dist.all_reduce(vector)  # 4000 bytes in
        gathered = torch.empty(1000 * world_size)
        dist.all_gather_into_tensor(gathered, vector)  # 4000 bytes in
        shard.full_tensor()  # a functional all-gather of 10 x 4 fp32: 160 bytes in
        square(torch.ones(64, 64) * (rank + 1))  # 2 * 64^3 FLOPs
        if rank == 0:
            torch.ones(32, 32) @ torch.ones(32, 32)  # rank 0 only: 2 * 32^3 more

    counts = count_step(step)
    return counts | {"flops_over_ranks": max_and_mean(counts["flops"])}


def test_counts_are_the_matmul_flops_and_the_bytes_each_rank_contributes() -> None:
    per_rank = run_on_ranks(_count, 2, timeout=120)
    for rank, counts in enumerate(per_rank):
        assert counts["collective_bytes"] == 4000 + 4000 + 160
        assert counts["flops"] == 2 * 64**3 + (2 * 32**3 if rank == 0 else 0)
    spread = per_rank[0]["flops_over_ranks"]
    assert spread["max"] == 2 * 64**3 + 2 * 32**3
    assert spread["mean"] == 2 * 64**3 + 32**3

"""Owner buckets never serialize Newton-Schulz: with every matrix over the bucket bound, split and
unsplit, the ranks' NS runs side by side, not one matrix at a time (``bucket_schedule``).

The sequential bucket model (``bucket_schedule.critical_path``) is checked against what bucketing
by bytes did to split plans (each matrix its own bucket, every rank waiting on its owner), and
one launch of 2 CPU ranks steps ``ShardedMuon`` and logs each rank's NS calls (the profiler scope
``NS_SCOPE``): both ranks' first NS calls run at the same time, which a schedule that serialized
them (a rank waiting for the other's result before its own NS) cannot show. On a loaded machine
the calls stretch, but their order and overlap stay.
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.engine.bucket_cuts import bucket_by_bytes
from megatron_muon.engine.bucket_schedule import BucketJob, critical_path
from megatron_muon.engine.layout import RowLayout
from megatron_muon.engine.step_plan import NSMatrix, bucket_job, plan_step
from megatron_muon.newton_schulz.methods import NSConfig
from megatron_muon.testing import run_on_ranks
from tests.muon_reference import MUON_KWARGS, full_tensor
from tests.row_split_parity import set_sharded_grad, sharded_param, splits_for_rows

SMALL, LARGE = 256, 512  # 256 KiB / 1 MiB of fp32; NS ~0.5 / ~4 GFLOP
BOUND = 64 * 2**10  # below every matrix's fp32 size
# Unsplit: 4 equal matrices, 2 per rank. Split: one large matrix (8x a small one's NS) and 4 small
# ones; one owner each would load the ranks 8:4, so the planner splits the large one over both
# (matrices from MIN_SPLIT up may split).
CASES = {"unsplit": [SMALL] * 4, "split": [LARGE] + [SMALL] * 4}
MIN_SPLIT = 2 * 10**9


def _matrices(sides: list[int], world_size: int) -> list[NSMatrix]:
    matrices = []
    for i, side in enumerate(sides):
        rows = splits_for_rows(side, world_size)
        stops = [sum(rows[: r + 1]) for r in range(world_size)]
        ranges = tuple((stop - held, stop) for stop, held in zip(stops, rows, strict=True))
        matrices.append(NSMatrix(i, RowLayout(side, (side,), ranges)))
    return matrices


def test_buckets_of_a_split_plan_keep_ranks_concurrent_where_bucketing_by_bytes_serialized():
    config = NSConfig()
    sides = CASES["split"]
    plan = plan_step(
        _matrices(sides, 2), 2, config, bucket_size_bytes=BOUND, min_split_flops=MIN_SPLIT
    )
    assert plan.owner_plan.split_matrices() == [0]
    jobs = [bucket_job(record, config) for record in plan.matrices]
    largest = max(plan.owner_plan.loads)
    assert plan.owner_plan.critical_path == critical_path(jobs, plan.buckets, 2) <= 1.01 * largest
    # Bucketing by bytes (what split plans had): every matrix alone, its rows' holders waiting.
    by_bytes = critical_path(jobs, bucket_by_bytes([4 * s * s for s in sides], BOUND), 2)
    assert by_bytes >= 1.3 * largest


def test_critical_path_is_the_sum_when_every_rank_waits_on_one_owner():
    # Ranks 0 and 1 hold rows of both matrices; both are owned by rank 0: nothing runs beside.
    jobs = [BucketJob(((0, 5),), (0, 1), (8,)), BucketJob(((0, 7),), (0, 1), (8,))]
    assert critical_path(jobs, [[0], [1]], 2) == 12
    # Owned by different ranks, each in its own bucket: still one after the other (rows wait).
    jobs[1] = BucketJob(((1, 7),), (0, 1), (8,))
    assert critical_path(jobs, [[0], [1]], 2) == 12
    assert critical_path(jobs, [[0, 1]], 2) == 7


def _ns_log(rank: int, world_size: int) -> dict:
    """Per case: this rank's NS intervals (seconds from a barrier both ranks left together) in the
    second step, and the plan's split matrices and buckets."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_muon import ShardedMuon
    from megatron_muon.engine.ns_runner import NS_SCOPE

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for case, sides in CASES.items():
        rows = [splits_for_rows(side, world_size) for side in sides]
        fulls = [full_tensor((side, side), seed=i) for i, side in enumerate(sides)]
        params = [sharded_param(f, r, rank, mesh) for f, r in zip(fulls, rows, strict=True)]
        optimizer = ShardedMuon.from_keywords(
            params, **MUON_KWARGS, bucket_size_bytes=BOUND, min_split_flops=MIN_SPLIT
        )
        for step in range(2):  # the first step builds the plan and the exchanges
            for i, (p, f) in enumerate(zip(params, fulls, strict=True)):
                grad = full_tensor(f.shape, seed=10 * step + i)
                set_sharded_grad(p, grad, rows[i], rank, True)
            if step == 0:
                optimizer.step()
                continue
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                with torch.profiler.record_function("sync"):
                    dist.barrier()
                optimizer.step()
        events = prof.events()
        zero = next(e for e in events if e.name == "sync").time_range.end
        out[case] = {
            "ns": sorted(
                ((e.time_range.start - zero) / 1e6, (e.time_range.end - zero) / 1e6)
                for e in events
                if e.name == NS_SCOPE
            ),
            "split": optimizer.owner_plan().split_matrices(),
        }
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


@pytest.mark.multirank
def test_ranks_run_newton_schulz_side_by_side_with_matrices_over_the_bucket_bound():
    results = run_on_ranks(_ns_log, 2, timeout=120)
    for case in CASES:
        logs = [r[case] for r in results]
        assert bool(logs[0]["split"]) == (case == "split"), logs[0]
        assert all(log["ns"] for log in logs), (case, logs)
        # Serialized, a rank's first NS would wait for the other's result (it holds its rows):
        # side by side, both ranks' first NS calls run at once, whatever the machine's load.
        firsts = [log["ns"][0] for log in logs]
        assert max(start for start, _ in firsts) < min(stop for _, stop in firsts), (case, logs)
        busy = [_union(log["ns"]) for log in logs]
        together = sum(busy) - _union([i for log in logs for i in log["ns"]])
        assert together > 0, (case, logs)

"""The harness and the pinned stack: collectives, DTensor, Megatron-FSDP on CPU ranks."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist

from megatron_muon.testing import RankFailure, RankTimeout, run_on_ranks
from tests.fsdp_models import ToyMLP, fully_shard_toy

pytestmark = pytest.mark.multirank  # every test here launches ranks


def _uneven_rows(world_size: int) -> list[int]:
    return [(3 * r + 1) % 5 for r in range(world_size)]  # includes 0-row ranks for world >= 4


def _padded_all_gather(rank: int, world_size: int) -> list[torch.Tensor]:
    rows = _uneven_rows(world_size)
    cols = 3
    local = torch.arange(rows[rank] * cols, dtype=torch.float32).view(-1, cols) + 100 * rank
    max_rows = max(rows)
    padded = torch.zeros(max_rows, cols)
    padded[: rows[rank]] = local
    out = torch.empty(world_size * max_rows, cols)
    dist.all_gather_single(out, padded)
    pieces = out.view(world_size, max_rows, cols)
    return [pieces[r, : rows[r]].clone() for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_padded_all_gather_of_uneven_row_shards_reassembles_every_rank(world_size):
    results = run_on_ranks(_padded_all_gather, world_size)
    rows = _uneven_rows(world_size)
    for gathered in results:
        for r in range(world_size):
            expected = torch.arange(rows[r] * 3, dtype=torch.float32).view(-1, 3) + 100 * r
            torch.testing.assert_close(gathered[r], expected, rtol=0, atol=0)


def _all_to_all_uneven(rank: int, world_size: int) -> torch.Tensor:
    # rank r sends (r + d + 1) values to rank d, each value encoding (src, dst).
    send_sizes = [rank + d + 1 for d in range(world_size)]
    recv_sizes = [s + rank + 1 for s in range(world_size)]
    send = torch.cat([torch.full((n,), 10.0 * rank + d) for d, n in enumerate(send_sizes)])
    recv = torch.empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes)
    return recv


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_with_uneven_splits_delivers_each_block_to_its_rank(world_size):
    results = run_on_ranks(_all_to_all_uneven, world_size)
    for rank, recv in enumerate(results):
        expected = torch.cat(
            [torch.full((s + rank + 1,), 10.0 * s + rank) for s in range(world_size)]
        )
        torch.testing.assert_close(recv, expected, rtol=0, atol=0)


def _dtensor_round_trip(rank: int, world_size: int) -> torch.Tensor:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(8 * world_size * 5, dtype=torch.float32).view(8 * world_size, 5)
    local = full.chunk(world_size)[rank].clone()
    dt = DTensor.from_local(local, mesh, [Shard(0)])
    assert dt.shape == full.shape
    return dt.full_tensor()


@pytest.mark.parametrize("world_size", [2, 3])
def test_dtensor_shard0_round_trip_on_cpu_mesh(world_size):
    results = run_on_ranks(_dtensor_round_trip, world_size)
    full = torch.arange(8 * world_size * 5, dtype=torch.float32).view(8 * world_size, 5)
    for gathered in results:
        torch.testing.assert_close(gathered, full, rtol=0, atol=0)


def _fsdp_adamw_steps(rank: int, world_size: int, strategy: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = ToyMLP()
    reference = copy.deepcopy(model)
    wrapped = fully_shard_toy(model, world_size, strategy)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        inputs = torch.randn(world_size * 4, 16, generator=gen)
        targets = torch.randn(world_size * 4, 16, generator=gen)
        # reference: the whole batch in one process
        reference_optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(inputs), targets).backward()
        reference_optimizer.step()
        # sharded: this rank's slice of the batch
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        mine = slice(rank * 4, (rank + 1) * 4)
        torch.nn.functional.mse_loss(wrapped(inputs[mine]), targets[mine]).backward()
        wrapped.finish_grad_sync()
        optimizer.step()
        wrapped.install_optimized_model_weights()
    errors = {}
    for (name, p), ref in zip(wrapped.named_parameters(), reference.parameters(), strict=True):
        local = p.to_local() if hasattr(p, "to_local") else p
        offset = _row_offset(p, local)
        expected = ref.detach()[offset : offset + local.shape[0]]
        errors[name] = ((local - expected).norm() / expected.norm().clamp_min(1e-12)).item()
    return errors


def _row_offset(p: torch.Tensor, local: torch.Tensor) -> int:
    if local.shape == p.shape:
        return 0
    row_numel = max(1, local.shape[1:].numel())
    return p.megatron_fsdp_slice.start // row_numel


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_megatron_fsdp_fully_shard_matches_single_process_adamw(strategy):
    results = run_on_ranks(_fsdp_adamw_steps, 2, strategy, 3)
    for errors in results:
        for name, err in errors.items():
            assert err < 1e-5, f"{strategy}: {name} rel. error {err:.2e}"


def _hang_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(60)


def test_a_hanging_rank_fails_within_the_timeout_and_is_named():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[1\] of 2 did not finish"):
        run_on_ranks(_hang_on_rank_one, 2, timeout=3)
    assert time.monotonic() - start < 15


def _raise_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        raise ValueError("boom on rank zero")
    dist.barrier()


def test_an_exception_on_one_rank_reaches_pytest_with_its_traceback():
    with pytest.raises(RankFailure, match="(?s)rank 0.*boom on rank zero"):
        run_on_ranks(_raise_on_rank_zero, 2, timeout=30)

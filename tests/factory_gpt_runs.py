"""Tiny-GPT runs shared by the factory feature tests: a megatron-core GPT under Megatron-FSDP
(megatron-core's ``FullyShardedDataParallel``, ``optim_grads_params``, gloo) with its optimizer
built by ``build_muon_optimizer``, stepped on each rank's share of the same data at any DP size,
and each rank's rows of every param, to assemble and compare; and the parity runs beside the
unsharded reference (``train_runs``, ``assert_matches_reference``).
"""

from __future__ import annotations

import torch

from tests import gpt_parity
from tests.gpt_parity import SEQ, Run
from tests.run_comparison import assert_steps_within_floor

RUN = Run(wrapper="mcore", strategy="optim_grads_params")
NUM_STEPS = 3
# Steps of the parity runs beside the unsharded reference (``train_runs``).
PARITY_STEPS = 5


def _build(world_size: int, fsdp_kwargs: dict, qk_clip=None, **build_kwargs):
    """(wrapped GPT, its optimizer params by name, factory-built optimizer); ``qk_clip``: a
    ``QKClipConfig``; ``build_kwargs`` go to ``gpt_parity.build_gpt`` (e.g. ``mla=True``)."""
    from megatron_muon import MuonFsdpConfig, build_muon_optimizer

    wrapped = gpt_parity.wrap(gpt_parity.build_gpt(**build_kwargs), RUN, world_size)
    named = dict(wrapped.named_parameters())  # the optimizer params, right after wrapping
    optimizer = build_muon_optimizer(
        gpt_parity.optimizer_config(),
        [wrapped],
        fsdp_config=MuonFsdpConfig(**fsdp_kwargs),
        qk_clip=qk_clip,
    )
    return wrapped, named, optimizer


def _step(wrapped, optimizer, step: int, rank: int, world_size: int) -> None:
    """One step on this rank's share of ``batch(step, 2)`` (the same data at DP=1 and DP=2)."""
    tokens, labels = gpt_parity.batch(step, 2)
    mine = tokens.view(world_size, -1, SEQ)[rank], labels.view(world_size, -1, SEQ)[rank]
    optimizer.zero_grad()
    gpt_parity.loss_of(wrapped, *mine).backward()
    ok, _, _ = optimizer.step()
    assert ok


def _rows(named: dict) -> dict[str, tuple[int, torch.Tensor]]:
    """name -> (first row, this rank's rows) of every optimizer param."""
    from megatron_muon.engine.layout import local_tensor

    out = {}
    for name, param in named.items():
        local = local_tensor(param.detach()).clone()
        row_numel = max(1, local.shape[1:].numel())
        full_rows = tuple(local.shape) == tuple(param.shape)
        start = 0 if full_rows else param.megatron_fsdp_slice.start // row_numel
        out[gpt_parity._strip(name)] = (start, local)
    return out


def _assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The full tensors from the ranks' row pieces."""
    full = {}
    for name in per_rank[0]:
        pieces = sorted({(r[name][0], r[name][1].shape[0]): r[name][1] for r in per_rank}.items())
        full[name] = torch.cat([rows for (_, _), rows in pieces])
    return full


def train_runs(rank: int, world_size: int, runs: list, moe: bool = False) -> list:
    gpt_parity.init_megatron()
    return [gpt_parity.train(run, rank, world_size, PARITY_STEPS, moe) for run in runs]


def by_run(results: list[list[dict]], runs: list[Run]) -> dict[Run, list[dict]]:
    """run -> its per-rank results."""
    return {run: [rank_results[i] for rank_results in results] for i, run in enumerate(runs)}


def assert_matches_reference(per_rank: list[dict]) -> float:
    errors = gpt_parity.assert_within_floor(per_rank, per_rank[0]["floor"])
    worst = max(errors, key=errors.get)
    print(f"\n{per_rank[0]['summary']}\nlargest deviation: {worst} {errors[worst]:.2e}")
    for rank, result in enumerate(per_rank):
        # Floor-judged (tests/run_comparison.py). The grad norm is global over FSDP shards (stock
        # ChainedOptimizer: local shards only).
        assert_steps_within_floor(f"rank {rank}", result["stats"])
        for step, stats in enumerate(result["stats"]):
            # Only key-bias grads (mathematically zero, ~1e-12 in fp32: 2 x 64) may differ.
            assert abs(stats["num_zeros"] - stats["reference_num_zeros"]) <= 128, step
    return errors[worst]

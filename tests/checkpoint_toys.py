"""The toy runs the checkpoint tests share: a Megatron-FSDP-wrapped ``ToyMLP`` (or ``ToyMoE``)
trained by ``ShardedMuon`` (matrices) and torch ``AdamW`` (biases) under a warm-up scheduler, saved
and loaded in ``run_on_ranks`` launches, and snapshots of params and optimizer state to compare.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_muon.testing import run_on_ranks
from tests.muon_reference import MUON_KWARGS

# The next step after a reshard equals the never-resharded run's within this (relative): the
# gradients' all-reduce order differs with DP size.
RESHARD_TOLERANCE = 1e-6
GLOBAL_BATCH = 12  # divisible by every DP size used here
DIM = 16


class WarmupScheduler:
    """lr = base_lr * min(1, (t + 1) / warmup) on every group of the given optimizers."""

    def __init__(self, optimizers, warmup: int = 4) -> None:
        self.groups = [g for o in optimizers for g in o.param_groups]
        self.base_lrs = [g["lr"] for g in self.groups]
        self.warmup = warmup
        self.num_steps = 0
        self._apply()

    def _apply(self) -> None:
        factor = min(1.0, (self.num_steps + 1) / self.warmup)
        for group, base in zip(self.groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

    def step(self) -> None:
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"base_lrs": list(self.base_lrs), "num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.base_lrs = list(state["base_lrs"])
        self.num_steps = state["num_steps"]
        self._apply()


class ToyMoE(torch.nn.Module):
    """A router and ``num_experts`` two-layer experts as 3-D weights ``(E, out, in)``: Megatron-FSDP
    shards them by whole experts (rows of dim 0), unevenly for 5 experts on 2 or 3 ranks."""

    def __init__(self, dim: int = DIM, hidden: int = 24, num_experts: int = 5) -> None:
        super().__init__()
        self.router = torch.nn.Linear(dim, num_experts)
        self.experts_fc1 = torch.nn.Parameter(torch.randn(num_experts, hidden, dim) / dim**0.5)
        self.experts_fc2 = torch.nn.Parameter(torch.randn(num_experts, dim, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sigmoid scores (as Megatron's moe_router_score_function="sigmoid"): a softmax router's
        # gradient has rows summing to zero, so one singular value is pure fp32 noise that NS
        # amplifies ~3.4^5-fold; a reshard comparison would then measure noise, not placement.
        weights = torch.sigmoid(self.router(x))
        hidden = torch.relu(torch.einsum("bd,ehd->beh", x, self.experts_fc1))
        outputs = torch.einsum("beh,edh->bed", hidden, self.experts_fc2)
        return torch.einsum("be,bed->bd", weights, outputs)


def build(
    world_size: int,
    strategy: str,
    seed: int = 0,
    hidden: int = 48,
    all_adam: bool = False,
    moe: bool = False,
    adaptive: str | None = None,
):
    """Wrapped ToyMLP (or ToyMoE), [ShardedMuon(s), AdamW] with state for every param, scheduler.

    ``adaptive``: the matrices train with ``ShardedAdaptiveMuon`` of that second-moment method.

    ToyMoE's 3-D expert weights get their own ShardedMuon over an expert data-parallel group (all
    ranks: expert-parallel size 1), as the factory routes Megatron's experts.
    """
    from megatron_muon import ShardedMuon
    from megatron_muon.checkpointing import ensure_optimizer_state, named_optimizer_params
    from tests.fsdp_models import ToyMLP, fully_shard_toy, hsdp_shard_toy

    torch.manual_seed(seed)
    module = ToyMoE() if moe else ToyMLP(dim=DIM, hidden=hidden)
    dp_group = None
    if strategy.endswith("_bf16"):  # bf16 compute weights; Megatron-FSDP keeps fp32 main weights
        module = module.to(torch.bfloat16)
        strategy = strategy.removesuffix("_bf16")
    if strategy.startswith("hsdp_"):
        wrapped, dp_group = hsdp_shard_toy(module, outer=strategy.removeprefix("hsdp_"))
    else:
        wrapped = fully_shard_toy(module, world_size, strategy)
    named = named_optimizer_params(wrapped)
    matrices = [p for _, p in named if p.ndim == 2 and not all_adam]
    experts = [p for _, p in named if p.ndim == 3]
    others = [p for _, p in named if p.ndim == 1 or (p.ndim == 2 and all_adam)]
    optimizers: list = [torch.optim.AdamW(others, lr=1e-2, weight_decay=0.1)]
    if experts:
        expert_group = dist.new_group(list(range(world_size)))
        optimizers.insert(
            0, ShardedMuon.from_keywords(experts, dp_group=expert_group, **MUON_KWARGS)
        )
    if matrices and adaptive is not None:
        from megatron_muon.optimizers.adaptive_muon import ShardedAdaptiveMuon
        from megatron_muon.optimizers.adaptive_muon_config import AdaptiveMuonConfig

        config = AdaptiveMuonConfig(moment2_method=adaptive)  # type: ignore[arg-type]
        matrix_optimizer = ShardedAdaptiveMuon.from_keywords(
            matrices, adaptive=config, dp_group=dp_group, **MUON_KWARGS
        )
        optimizers.insert(0, matrix_optimizer)
    elif matrices:
        optimizers.insert(0, ShardedMuon.from_keywords(matrices, dp_group=dp_group, **MUON_KWARGS))
    ensure_optimizer_state(optimizers)  # before the first step: no lazily missing state anywhere
    return wrapped, optimizers, WarmupScheduler(optimizers)


def train(
    wrapped, optimizers, scheduler, rank, world_size, steps, first_step, noise, dtype=torch.float32
) -> None:
    per_rank = GLOBAL_BATCH // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for step in range(first_step, first_step + steps):
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(GLOBAL_BATCH, DIM, generator=generator)[mine]
        targets = torch.randn(GLOBAL_BATCH, DIM, generator=generator)[mine]
        if noise:  # draws from this rank's global RNG: differs unless the RNG state is restored
            inputs = inputs + 0.1 * torch.randn_like(inputs)
        inputs, targets = inputs.to(dtype), targets.to(dtype)
        wrapped.zero_grad_buffer()
        for optimizer in optimizers:
            optimizer.zero_grad()
        torch.nn.functional.mse_loss(wrapped(inputs), targets).backward()
        wrapped.finish_grad_sync()
        for optimizer in optimizers:
            optimizer.step()
        wrapped.install_optimized_model_weights()
        scheduler.step()


def local_snapshot(wrapped, optimizers) -> dict:
    """This rank's params and optimizer state by name (local shards), and the group lrs."""
    from megatron_muon.checkpointing import named_optimizer_params
    from megatron_muon.engine.layout import local_tensor

    named = named_optimizer_params(wrapped)
    state = {}
    for name, param in named:
        for optimizer in optimizers:
            if param in optimizer.state:
                state[name] = {  # a Python-int step (SOAP's, LaProp's) as it is
                    k: local_tensor(v).detach().clone() if torch.is_tensor(v) else v
                    for k, v in optimizer.state[param].items()
                }
    return {
        "params": {n: local_tensor(p).detach().clone() for n, p in named},
        "state": state,
        "lrs": [g["lr"] for o in optimizers for g in o.param_groups],
    }


def full_snapshot(wrapped, optimizers) -> dict:
    """Params and optimizer state gathered to full tensors (true uneven row layouts)."""
    from torch.distributed.tensor import DTensor

    from megatron_muon.checkpointing import named_optimizer_params
    from megatron_muon.engine.layout import gather_row_layouts, local_tensor

    named = named_optimizer_params(wrapped)
    layouts = gather_row_layouts([p for _, p in named], None)

    def full(tensor: torch.Tensor, layout) -> torch.Tensor:
        # 0-d (Adam's step) or a plain replicated tensor (normuon's / namo's second moment).
        if not torch.is_tensor(tensor):  # a Python-int step (SOAP's, LaProp's)
            return tensor
        if tensor.ndim == 0 or not isinstance(tensor, DTensor):
            return tensor.detach().clone()
        pieces: list = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, local_tensor(tensor).detach().clone())
        result = torch.empty(layout.shape, dtype=tensor.dtype)
        for (start, stop), piece in zip(layout.ranges, pieces, strict=True):
            result[start:stop] = piece
        return result

    params, state = {}, {}
    for (name, param), layout in zip(named, layouts, strict=True):
        params[name] = full(param, layout)
        for optimizer in optimizers:
            if param in optimizer.state:
                state[name] = {k: full(v, layout) for k, v in optimizer.state[param].items()}
    layout_rows = {n: layout.ranges for (n, _), layout in zip(named, layouts, strict=True)}
    return {"params": params, "state": state, "layouts": layout_rows}


def _dtype(strategy: str) -> torch.dtype:
    return torch.bfloat16 if strategy.endswith("_bf16") else torch.float32


def train_save_train(rank, world_size, strategy, path, k, n) -> dict:
    from megatron_muon.checkpointing import named_optimizer_params, save_checkpoint
    from megatron_muon.engine.layout import gather_row_layouts

    wrapped, optimizers, scheduler = build(world_size, strategy)
    train(
        wrapped, optimizers, scheduler, rank, world_size, k, 0, noise=True, dtype=_dtype(strategy)
    )
    save_checkpoint(path, wrapped, optimizers, scheduler, iteration=k, extra={"tokens": 7})
    train(
        wrapped, optimizers, scheduler, rank, world_size, n, k, noise=True, dtype=_dtype(strategy)
    )
    named = named_optimizer_params(wrapped)
    layouts = gather_row_layouts([p for _, p in named], None)
    return {
        "snapshot": local_snapshot(wrapped, optimizers),
        "layouts": {name: layout.ranges for (name, _), layout in zip(named, layouts, strict=True)},
    }


def load_train(rank, world_size, strategy, path, n) -> dict:
    from megatron_muon.checkpointing import load_checkpoint

    # A different init seed: everything that matters must come from the checkpoint.
    wrapped, optimizers, scheduler = build(world_size, strategy, seed=123)
    loaded = load_checkpoint(path, wrapped, optimizers, scheduler)
    train(
        wrapped,
        optimizers,
        scheduler,
        rank,
        world_size,
        n,
        loaded.iteration,
        noise=True,
        dtype=_dtype(strategy),
    )
    return {
        "snapshot": local_snapshot(wrapped, optimizers),
        "iteration": loaded.iteration,
        "extra": loaded.extra,
        "rng_restored": loaded.rng_restored,
    }


def assert_bitwise_equal(expected: dict, actual: dict, where: str) -> None:
    assert expected["lrs"] == actual["lrs"], where
    for name, tensor in expected["params"].items():
        assert torch.equal(tensor, actual["params"][name]), f"{where}: param {name}"
    for name, state in expected["state"].items():
        for key, tensor in state.items():
            got = actual["state"][name][key]
            same = torch.equal(tensor, got) if torch.is_tensor(tensor) else tensor == got
            assert same, f"{where}: {name}.{key}"


def _try_loads(rank, world_size, paths, hidden=48, save_all_adam_to=None) -> list[dict]:
    """Builds Muon+AdamW on ToyMLP(hidden) and tries to load each of ``paths``; reports each error
    and whether params and optimizer state are untouched. With ``save_all_adam_to``, first saves a
    checkpoint whose matrices are trained by AdamW (the "Adam state into Muon" case)."""
    from megatron_muon.checkpointing import CheckpointError, load_checkpoint, save_checkpoint

    if save_all_adam_to is not None:
        wrapped, optimizers, scheduler = build(world_size, "optim", all_adam=True)
        train(wrapped, optimizers, scheduler, rank, world_size, 1, 0, noise=False)
        save_checkpoint(save_all_adam_to, wrapped, optimizers, scheduler, iteration=1)
    wrapped, optimizers, scheduler = build(world_size, "optim", seed=5, hidden=hidden)
    train(wrapped, optimizers, scheduler, rank, world_size, 1, 0, noise=False)
    before = local_snapshot(wrapped, optimizers)
    results = []
    for path in paths:
        try:
            load_checkpoint(path, wrapped, optimizers, scheduler)
            results.append({"type": None, "message": "", "unchanged": None})
            continue
        except CheckpointError as error:
            result = {"type": type(error).__name__, "message": str(error), "unchanged": True}
        try:
            assert_bitwise_equal(before, local_snapshot(wrapped, optimizers), "after a failure")
        except AssertionError:
            result["unchanged"] = False
        results.append(result)
    return results


def assert_loads_fail(cases: list[tuple[str, str, tuple[str, ...]]], **kwargs) -> None:
    """``cases``: (path, error class name, phrases its message must hold); one launch for all."""
    per_rank = run_on_ranks(_try_loads, 2, [path for path, _, _ in cases], **kwargs)
    for rank, results in enumerate(per_rank):
        for (path, kind, phrases), result in zip(cases, results, strict=True):
            assert result["type"] == kind, (rank, path, result)
            for phrase in phrases:
                assert phrase in result["message"], (rank, phrase, result["message"])
            assert result["unchanged"], f"rank {rank}: state changed by a failed load of {path}"


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_resharded(reference: dict, results: list[dict]) -> None:
    for result in results:
        assert not result["rng_restored"]
        loaded, saved = result["loaded"], reference["saved"]
        # Params, Muon momentum, AdamW moments and step: exactly the saved values, on every row.
        for name, tensor in saved["params"].items():
            assert torch.equal(loaded["params"][name], tensor), name
        for name, state in saved["state"].items():
            assert set(loaded["state"][name]) == set(state), name
            for key, tensor in state.items():
                assert torch.equal(loaded["state"][name][key], tensor), f"{name}.{key}"
        # The next step equals the never-resharded run's (grad reduction order differs).
        for name, tensor in reference["next"]["params"].items():
            assert _relative(result["next"]["params"][name], tensor) <= RESHARD_TOLERANCE, name
        for name, state in reference["next"]["state"].items():
            for key, tensor in state.items():
                if tensor.ndim:
                    error = _relative(result["next"]["state"][name][key], tensor)
                    assert error <= RESHARD_TOLERANCE, f"{name}.{key}: {error:.2e}"


def owner_held_state(wrapped, optimizer) -> dict[str, dict]:
    """name -> {key: whole tensor (from the rank holding it) or step} of every param of an
    owner-computed ``optimizer`` (``ShardedSOAP``, ...). Collective."""
    from megatron_muon.checkpointing import named_optimizer_params
    from megatron_muon.engine.layout import local_tensor

    out = {}
    for name, param in named_optimizer_params(wrapped):
        if param not in optimizer.state:
            continue
        out[name] = {}
        for key, value in optimizer.state[param].items():
            if not torch.is_tensor(value):
                out[name][key] = value
                continue
            pieces: list = [None] * dist.get_world_size()
            dist.all_gather_object(pieces, local_tensor(value).detach().clone())
            held = [piece for piece in pieces if piece.shape[0]]
            assert all(torch.equal(piece, held[0]) for piece in held), (name, key)
            out[name][key] = held[0]
    return out

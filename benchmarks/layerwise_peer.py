"""Megatron's own distributed Muon next to ours: megatron-core's ``LayerWiseDistributedOptimizer``
(Megatron-LM's ``--optimizer muon --use-distributed-optimizer``: Megatron's DDP, whole matrices
per DP rank, the updated params all-gathered) against ``build_muon_optimizer`` on Megatron-FSDP,
twice: with the default NS (emerging-optimizers' ``newton_schulz``, the one LayerWise runs) and with
``ns_method="symmetric"`` (``OURS_SIDES``).

Both train the same bf16 ``GPTModel`` (the training-step model; seed 0) on the same batches
(every DP rank the whole batch: ``_train`` says why), from the same weights. bf16 because stock
megatron-core 0.19.2's ``LayerWiseDistributedOptimizer`` wraps its sub-optimizers in Megatron's
optimizer classes only under bf16 (``layer_wise_optimizer.py`` ~:503): with fp32 params it stops
at build (``'TensorParallelMuon' object has no attribute 'config'``). On CPU it runs through the
Megatron-DDP stand-ins of ``megatron_muon.cpu_stand_ins`` (buffers on ``current_device()``, CUDA
type checks).

Exactness: the fp32 main weights of every Muon matrix after 1 and after ``STEPS`` steps (NS in
fp32, "highest", on every side) against one single-process reference, megatron-core's
non-distributed Muon (``TensorParallelMuon`` in its bf16 optimizer) on Megatron's DDP on one rank
with the whole batch, as max |got - reference| over max |reference - initial| (relative to the
update; ``CHECKPOINTS`` says why both). Time: ``optimizer.step()`` of each, stepped in
turn on the last step's gradients (median, min, max), one step's transient memory, FLOPs and
collective bytes (``benchmarks.step_counts``), and the whole training step (median).

Where ``benchmarks.machine`` found bf16 matmuls slow (NS in fp32; a CPU without bf16
instructions), the bf16 forward and backward would not finish in the bench's time (measured on a
2-core AMD EPYC: 10.7 s per training step at 64 tokens), so both sides train on
``SLOW_BF16_SEQ_LENGTH``-token micro-batches and the whole training step is not timed: the
optimizer steps, their matrices and so their times are the same at any tokens per step.
"""

from __future__ import annotations

import dataclasses
import os
from statistics import median

import torch
import torch.distributed as dist

from benchmarks.models import GPTSize
from benchmarks.optimizer_step import NS_PRECISION_ENV, time_samples
from benchmarks.step_counts import step_figures
from benchmarks.training_step import build_gpt, optimizer_config, torch_device
from megatron_muon.newton_schulz.matmul_rates import BF16_SLOW_FACTOR
from megatron_muon.newton_schulz.methods import DEFAULT_NS_METHOD, NSMethodT

__all__ = [
    "OURS_SIDES",
    "STEPS",
    "errors",
    "layerwise_reference",
    "layerwise_section",
    "layerwise_vs_ours",
]

STEPS = 3
# Ours, once per NS method compared: the default (emerging-optimizers' newton_schulz, the NS
# LayerWise runs) and the symmetric method (the same iteration, its symmetric products by halves).
OURS_SIDES: dict[str, NSMethodT] = {"ours": DEFAULT_NS_METHOD, "ours_symmetric_ns": "symmetric"}
# Main weights are compared after step 1 and after step STEPS. After step 1 an exact Muon matches
# the reference to fp32 reduction order (ours: 6e-6 of the update at DP=1); later steps start from
# bf16 compute weights rounded from main weights that may differ in the last fp32 bits, so a weight
# can round to the neighbouring bf16 value and the runs drift apart (seen: 3.8e-2 after 3 steps).
CHECKPOINTS = (range(0, 1), range(1, STEPS))
# Exact: after step 1, within fp32 reduction order of the reference (measured 0 and 6e-6).
EXACT_AFTER_ONE_STEP = 1e-4
# The Muon matrices compared (megatron-core routes these 2-D hidden weights to Muon).
MUON_MATRICES = (
    "linear_qkv.weight",
    "linear_proj.weight",
    "linear_fc1.weight",
    "linear_fc2.weight",
)
# NS in fp32 on every side: bf16 NS differs between implementations by ~1e-2 of the update.
_EXACT = {"muon_fp32_matmul_prec": "highest"}
GLOBAL_MICRO_BATCHES = 4  # rows of each batch, in micro-batch sizes
# Tokens per micro-batch (one sequence) where bf16 is slow (module docstring).
SLOW_BF16_SEQ_LENGTH = 16


class _WholeStep:
    """``step()``: one training step (forward, backward, gradient sync, optimizer step)."""

    def __init__(self, wrapped, optimizer, size: GPTSize, device: str) -> None:
        self.args = (wrapped, optimizer, size, device)

    def step(self) -> None:
        _train(*self.args, range(STEPS, STEPS + 1))


class _Stepper:
    """``step()`` as the timing helpers call it, for a Megatron optimizer."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        update_successful, _, _ = self.optimizer.step()
        if not update_successful:
            raise RuntimeError("the optimizer step was skipped (non-finite grads?)")


def _on_ddp(size: GPTSize, device: str, layer_wise: bool):
    """(Megatron-DDP model, megatron-core Muon): layer-wise distributed, or the plain one."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.training.training import wrap_model_chunks_with_ddp

    config, model = build_gpt(size, device, bf16=True)
    ddp_config = DistributedDataParallelConfig(
        gradient_reduce_div_fusion=False, grad_reduce_in_fp32=True
    )
    [wrapped] = wrap_model_chunks_with_ddp(
        [model], config, ddp_config, use_layer_wise_distributed_optimizer=layer_wise
    )
    muon = optimizer_config(
        "muon", bf16=True, **_EXACT, use_layer_wise_distributed_optimizer=layer_wise
    )
    return wrapped, get_megatron_optimizer(muon, [wrapped])


def _on_megatron_fsdp(size: GPTSize, device: str, ns_method: NSMethodT = DEFAULT_NS_METHOD):
    """(Megatron-FSDP model, ``build_muon_optimizer`` with ``ns_method``): optim_grads_params."""
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel

    from megatron_muon import build_muon_optimizer
    from megatron_muon.engine.config import MuonFsdpConfig

    config, model = build_gpt(size, device, bf16=True)
    ddp_config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params",
        use_megatron_fsdp=True,
        gradient_reduce_div_fusion=False,
        grad_reduce_in_fp32=True,
    )
    wrapped = FullyShardedDataParallel(config, ddp_config, model, device=torch_device(device))
    main_weights = {_strip(n): p for n, p in wrapped.named_parameters() if _is_muon(n)}
    muon = optimizer_config("muon", bf16=True, **_EXACT)
    optimizer = build_muon_optimizer(
        muon, [wrapped], grads_already_synced=True, fsdp_config=MuonFsdpConfig(ns_method=ns_method)
    )
    return wrapped, optimizer, main_weights


def _strip(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def _is_muon(name: str) -> bool:
    return name.endswith(MUON_MATRICES)


def _train(wrapped, optimizer, size: GPTSize, device: str, steps: range) -> None:
    """Training steps ``steps``, each on its own batch, the same batch on every DP rank.

    The same batch everywhere makes every rank's bf16 gradient bitwise the reference's, and their
    average exactly that gradient (fp32 sums of equal bf16-valued terms round nowhere), so what
    differs is the optimizer alone. Slices of one batch would differ in the bf16 weight gradients
    (rounded per slice): measured, that moved both Muons' updates by 6% (tiny GPT) to 40% (bench
    GPT) of the update after one step, Muon's NS amplifying noise in the small singular values.
    """
    rows = size.micro_batch * GLOBAL_MICRO_BATCHES
    ones = torch.ones(size.seq_length, size.seq_length, dtype=torch.bool, device=device)
    mask = torch.triu(ones, diagonal=1)[None, None]
    for step in steps:
        generator = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, size.vocab_size, (rows, size.seq_length), generator=generator)
        labels = torch.randint(0, size.vocab_size, (rows, size.seq_length), generator=generator)
        tokens, labels = tokens.to(device), labels.to(device)
        positions = torch.arange(size.seq_length, device=device).expand(tokens.shape)
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        loss = wrapped(input_ids=tokens, position_ids=positions, attention_mask=mask, labels=labels)
        loss.float().mean().backward()
        wrapped.finish_grad_sync()
        _Stepper(optimizer).step()


def _ddp_main_weights(wrapped, optimizer) -> dict[str, torch.Tensor]:
    """Rank 0: every Muon matrix's fp32 main weight, from the rank whose optimizer holds it."""
    names = {id(p): _strip(n) for n, p in wrapped.named_parameters()}
    mine = {}
    pending = [optimizer]
    while pending:  # Chained / LayerWise optimizers down to Megatron's bf16 optimizers
        node = pending.pop()
        pending.extend(getattr(node, "chained_optimizers", []))
        model_groups = getattr(node, "float16_groups", [])
        main_groups = getattr(node, "fp32_from_float16_groups", [])
        for model_group, main_group in zip(model_groups, main_groups, strict=True):
            for param, main in zip(model_group, main_group, strict=True):
                name = names.get(id(param), "")
                if _is_muon(name) and main.numel() == param.numel():
                    mine[name] = main.detach().float().cpu().clone()
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    return {name: tensor for part in gathered for name, tensor in part.items()}


def _fsdp_main_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank 0: the full fp32 main weights from every rank's Megatron-FSDP row shard (uneven shards:
    each located by ``megatron_fsdp_slice``)."""
    from megatron_muon.engine.layout import local_tensor

    mine = {}
    for name, param in weights.items():
        local = local_tensor(param.detach()).float().cpu().clone()
        row_numel = max(1, local.shape[1:].numel())
        whole = tuple(local.shape) == tuple(param.shape)
        mine[name] = (0 if whole else param.megatron_fsdp_slice.start // row_numel, local)
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    full = {}
    for name in mine:
        pieces = sorted(
            {(part[name][0], part[name][1].shape[0]): part[name][1] for part in gathered}.items()
        )
        full[name] = torch.cat([rows for _, rows in pieces])
    return full


def layerwise_reference(rank: int, world_size: int, device: str, size: GPTSize) -> dict:
    """Rank function (one rank): the reference's Muon main weights before and after the
    ``CHECKPOINTS``."""
    if world_size != 1:
        raise ValueError(f"the reference runs on one rank, got {world_size}")
    wrapped, optimizer = _on_ddp(size, device, layer_wise=False)
    initial = {_strip(n): p.detach().float().cpu().clone() for n, p in wrapped.named_parameters()}
    after = {}
    for steps in CHECKPOINTS:
        _train(wrapped, optimizer, size, device, steps)
        after[steps.stop] = _ddp_main_weights(wrapped, optimizer)
    return {"initial": {name: t for name, t in initial.items() if _is_muon(name)}, "after": after}


def layerwise_vs_ours(
    rank: int,
    world_size: int,
    device: str,
    size: GPTSize,
    warmup: int,
    repeats: int,
    whole_step: bool = True,
) -> dict:
    """Rank function: LayerWise and ours after ``STEPS`` steps (rank 0: main weights), then their
    optimizer steps timed in turn and one step's transient memory each, and (``whole_step``)
    their whole training steps."""
    layer_wise, layer_wise_optimizer = _on_ddp(size, device, layer_wise=True)
    ours = {side: _on_megatron_fsdp(size, device, method) for side, method in OURS_SIDES.items()}
    after: dict[str, dict] = {side: {} for side in ("layerwise", *ours)}
    for steps in CHECKPOINTS:
        _train(layer_wise, layer_wise_optimizer, size, device, steps)
        after["layerwise"][steps.stop] = _ddp_main_weights(layer_wise, layer_wise_optimizer)
        for side, (model, optimizer, weights) in ours.items():
            _train(model, optimizer, size, device, steps)
            after[side][steps.stop] = _fsdp_main_weights(weights)
    steppers = {side: _Stepper(optimizer) for side, (_, optimizer, _) in ours.items()}
    steppers["layerwise"] = _Stepper(layer_wise_optimizer)
    times = step_figures(steppers, device, warmup, repeats)
    if not whole_step:
        return {"after": after, "times": times} if rank == 0 else {}
    # The whole training step too: DDP all-reduces gradients before its optimizer step, where
    # Megatron-FSDP reduce-scatters them and ours exchanges rows inside the step.
    whole = {
        side: _WholeStep(model, optimizer, size, device)
        for side, (model, optimizer, _) in ours.items()
    }
    whole["layerwise"] = _WholeStep(layer_wise, layer_wise_optimizer, size, device)
    for name, values in time_samples(whole, device, warmup, repeats).items():
        times[name]["whole_step_s"] = median(values)
    return {"after": after, "times": times} if rank == 0 else {}


def errors(after: dict, reference: dict) -> dict[str, dict[int, float]]:
    """``{side: {steps: relative_error}}`` of ``layerwise_vs_ours``'s main weights against
    ``layerwise_reference``'s."""
    return {
        side: {
            steps: relative_error(weights, reference["after"][steps], reference["initial"])
            for steps, weights in by_steps.items()
        }
        for side, by_steps in after.items()
    }


def relative_error(got: dict, reference: dict, initial: dict) -> float:
    """max over the Muon matrices of max |got - reference| / max |reference - initial|."""
    return max(
        float((got[n] - reference[n]).abs().max() / (reference[n] - initial[n]).abs().max())
        for n in reference
    )


def layerwise_section(
    size: GPTSize, device: str, dp_sizes: list[int], warmup: int, repeats: int
) -> dict:
    """The LayerWise peer row: per DP >= 2, both sides' errors (``errors``), whether each is exact
    (its error after step 1 within ``EXACT_AFTER_ONE_STEP``) and step times, ``<side>_over_peer``
    for each of ``OURS_SIDES``
    (and the whole training step's, where bf16 is fast: module docstring)."""
    from benchmarks.launcher import run_ranks

    slow_bf16 = os.environ.get(NS_PRECISION_ENV) == "highest"  # benchmarks.machine's finding
    if slow_bf16:
        size = dataclasses.replace(size, seq_length=SLOW_BF16_SEQ_LENGTH, micro_batch=1)
    reference = run_ranks(layerwise_reference, 1, device, size)[0]
    row: dict[str, dict] = {}
    for dp in [dp for dp in dp_sizes if dp >= 2]:
        result = run_ranks(layerwise_vs_ours, dp, device, size, warmup, repeats, not slow_bf16)[0]
        errors_ = errors(result["after"], reference)
        times = result["times"]
        row[str(dp)] = {
            "errors": errors_,
            "exact": {side: errors_[side][1] <= EXACT_AFTER_ONE_STEP for side in errors_},
            "times": times,
            "tokens_per_step": size.tokens_per_rank() * GLOBAL_MICRO_BATCHES,
        }
        for side in OURS_SIDES:
            row[str(dp)][f"{side}_over_peer"] = (
                times[side]["seconds"] / times["layerwise"]["seconds"]
            )
        if slow_bf16:
            row[str(dp)]["whole_step_not_timed"] = (
                f"bf16 matmuls over {BF16_SLOW_FACTOR:.0f}x slower than fp32 here: both sides "
                f"train on {SLOW_BF16_SEQ_LENGTH}-token micro-batches (module docstring)"
            )
        else:
            for side in OURS_SIDES:
                row[str(dp)][f"whole_step_{side}_over_peer"] = (
                    times[side]["whole_step_s"] / times["layerwise"]["whole_step_s"]
                )
    return row

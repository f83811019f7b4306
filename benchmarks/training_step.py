"""Full training-step benchmarks: Muon vs AdamW on a Megatron-FSDP GPTModel.

The model is a megatron-core ``GPTModel`` (local layer spec) wrapped with megatron-core's
``FullyShardedDataParallel`` (Megatron-FSDP, ``optim_grads_params``). The optimizers are what a
Megatron user runs:

- ``muon``: ``megatron_muon.build_muon_optimizer`` (``ShardedMuon`` in owner mode for the 2-D hidden
  weights, AdamW for the rest, one grad norm and clipping over both, weights installed after the
  step);
- ``adamw``: megatron-core's ``get_megatron_optimizer`` with ``optimizer="adam"`` (its
  ``DistributedOptimizer`` over the Megatron-FSDP params).

Each kind trains its own copy of the model (same seed, same weights, same batch). One training
step is ``zero_grad_buffer`` -> forward -> backward -> ``finish_grad_sync`` (what Megatron-LM's
``finalize_model_grads`` does) -> ``optimizer.step()`` (grad norm, clipping, the update, the
install of the new weights into the compute weights); the *optimizer step* is the last of these.
Section 2 of ``python -m benchmarks`` (``SECTION``); the rank bodies also serve section 4
(``training_step_memory``), the ideal ratio and the GPU run (``Trainer``).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import get_args

import torch
import torch.distributed as dist

from benchmarks.config import BenchConfig
from benchmarks.launcher import run_ranks
from benchmarks.measure import MemoryProbe, median, return_freed_memory_to_os, timed
from benchmarks.models import GPTSize
from benchmarks.section import RunContext, Section
from benchmarks.tables import table

__all__ = [
    "SECTION",
    "Trainer",
    "build_gpt",
    "gpt_batch",
    "muon_vs_adamw_step",
    "optimizer_config",
    "torch_device",
    "training_step_memory",
    "training_step_section",
]

KINDS = ("muon", "adamw")
# What the Muon/AdamW step ratio is read against (results.json's training_step.anchor).
ANCHOR = "Megatron-LM PR #4486 (Muon on Megatron-FSDP): Muon steps 1.5x-2.7x slower than Adam"


def optimizer_config(kind: str, bf16: bool, **overrides):
    """megatron-core ``OptimizerConfig``: Megatron's defaults (Muon's included), clip 1.0, for bf16
    or fp32 params; ``overrides`` are further ``OptimizerConfig`` fields.

    ``kind``: ``"adamw"`` or an optimizer ``build_muon_optimizer`` builds for Megatron-FSDP
    (``common.options.FsdpOptimizerT``: ``"muon"``, ``"adaptive_muon"``, ...), each with the run's
    NS precision."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_muon.common.options import FsdpOptimizerT

    common = dict(
        lr=3e-4,
        min_lr=3e-4,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        clip_grad=1.0,
        bf16=bf16,
    )
    if kind in get_args(FsdpOptimizerT):
        from benchmarks.optimizer_step import MUON_KWARGS

        prec = MUON_KWARGS["fp32_matmul_prec"]
        emerging = {"optimizer": kind, "muon_fp32_matmul_prec": prec}
        return OptimizerConfig(**(common | emerging | overrides))
    if kind == "adamw":
        adam = {"optimizer": "adam", "use_distributed_optimizer": True}
        return OptimizerConfig(**(common | adam | overrides))
    choices = ("adamw", *get_args(FsdpOptimizerT))
    raise ValueError(f"unknown optimizer kind {kind!r}; expected one of {choices}")


def torch_device(device: str) -> torch.device:
    """``cuda:<current>`` (Megatron-FSDP warns about a bare ``cuda``) or ``cpu``."""
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def build_gpt(size: GPTSize, device: str, bf16: bool):
    """(config, the GPTModel of ``size``), seed 0, on CPU-initialized weights on a CPU run; with
    ``bf16``, bf16 compute weights as Megatron-LM's ``get_model`` makes them (with Megatron-FSDP
    too): the module cast to bf16 (``Float16Module``), its fp32 inputs cast on the way in."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    config = TransformerConfig(
        num_layers=size.num_layers,
        hidden_size=size.hidden,
        ffn_hidden_size=size.ffn_hidden,
        num_attention_heads=size.num_heads,
        use_cpu_initialization=device == "cpu",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=size.vocab_size,
        max_sequence_length=size.seq_length,
    )
    return config, Float16Module(config, model) if bf16 else model


def gpt_batch(size: GPTSize, device: str) -> dict[str, torch.Tensor]:
    """This rank's micro-batch of random tokens (seed 100 + rank) as ``GPTModel`` keywords:
    ``input_ids``, ``position_ids``, ``attention_mask`` (causal) and ``labels``."""
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    shape = (size.micro_batch, size.seq_length)
    tokens = torch.randint(0, size.vocab_size, shape, generator=generator).to(device)
    labels = torch.randint(0, size.vocab_size, shape, generator=generator).to(device)
    # Megatron's convention: True = masked out (causal: keys after the query).
    ones = torch.ones(size.seq_length, size.seq_length, dtype=torch.bool, device=device)
    return {
        "input_ids": tokens,
        "position_ids": torch.arange(size.seq_length, device=device).expand(shape),
        "attention_mask": torch.triu(ones, diagonal=1)[None, None],
        "labels": labels,
    }


class Trainer:
    """A wrapped GPTModel, its batch, and one optimizer kind on it (``optimizer_config``'s kinds:
    ``"adamw"`` through megatron-core, the others through ``build_muon_optimizer``).

    ``main_params_dtype``: Megatron-FSDP's main-weight buffer (``DistributedDataParallelConfig.
    megatron_fsdp_main_params_dtype``; Megatron-LM's ``--megatron-fsdp-main-params-dtype``, whose
    ``auto`` is None): fp32, Megatron's default, keeps a copy of the weights for the optimizer and
    installs it into the compute weights after each step; None lets the optimizer step the
    compute weights themselves (for a model computing in fp32, the copy holds the same values).
    """

    def __init__(
        self,
        size: GPTSize,
        world_size: int,
        device: str,
        kind: str,
        main_params_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        from megatron.core.distributed import (
            DistributedDataParallelConfig,
            FullyShardedDataParallel,
        )
        from megatron.core.optimizer import get_megatron_optimizer

        from megatron_muon import build_muon_optimizer

        self.device = device
        config, model = build_gpt(size, device, bf16=device == "cuda")
        ddp_config = DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params",
            use_megatron_fsdp=True,
            gradient_reduce_div_fusion=False,
            megatron_fsdp_main_params_dtype=main_params_dtype,
        )
        self.wrapped = FullyShardedDataParallel(
            config, ddp_config, model, device=torch_device(device)
        )
        # Both factories are built right after wrapping, from the Megatron-FSDP optimizer params.
        settings = optimizer_config(kind, bf16=device == "cuda")
        if kind != "adamw":
            # The loop below calls finish_grad_sync itself, as Megatron-LM's loop does.
            self.optimizer = build_muon_optimizer(
                settings, [self.wrapped], grads_already_synced=True
            )
        else:
            self.optimizer = get_megatron_optimizer(settings, [self.wrapped])
        self.batch = gpt_batch(size, device)

    def muon_ns_flops(self) -> int:
        """NS FLOPs of this rank's last step, summed over the factory's ShardedMuon optimizers."""
        from megatron_muon import ShardedMuon

        return sum(
            child.optimizer.step_stats.ns_flops
            for child in self.optimizer.chained_optimizers
            if isinstance(child.optimizer, ShardedMuon)
        )

    def forward_backward(self) -> None:
        self.wrapped.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss = self.wrapped(**self.batch)
        loss.float().mean().backward()
        self.wrapped.finish_grad_sync()

    def optimizer_step(self) -> None:
        update_successful, _, _ = self.optimizer.step()
        if not update_successful:
            raise RuntimeError("the optimizer step was skipped (non-finite grads?)")

    def timed_step(self) -> tuple[float, float]:
        """(whole step seconds, optimizer-step seconds), each between barriers."""
        whole = timed(self.forward_backward, self.device)
        optimizer = timed(self.optimizer_step, self.device)
        return whole + optimizer, optimizer


def muon_vs_adamw_step(
    rank: int, world_size: int, device: str, size: GPTSize, warmup: int, repeats: int
) -> dict:
    """Median whole-step and optimizer-step seconds of Muon and AdamW, alternating step by step."""
    trainers = {kind: Trainer(size, world_size, device, kind) for kind in KINDS}
    for _ in range(warmup):
        for trainer in trainers.values():
            trainer.timed_step()
    samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    for round_index in range(repeats):
        shift = round_index % len(KINDS)
        for kind in KINDS[shift:] + KINDS[:shift]:
            samples[kind].append(trainers[kind].timed_step())
    return {
        kind: {
            "step_s": median([whole for whole, _ in values]),
            "optimizer_s": median([opt for _, opt in values]),
        }
        for kind, values in samples.items()
    } | {"muon_ns_flops": trainers["muon"].muon_ns_flops()}


def _load_step_kernels(device: str) -> None:
    """One tiny Muon and AdamW step, so that one-time costs (kernel code, library state) land in
    the start-up level for both optimizer kinds alike, not in one kind's step."""
    from megatron_muon import ShardedMuon

    matrix = torch.nn.Parameter(torch.randn(64, 128, device=device))
    vector = torch.nn.Parameter(torch.randn(64, device=device))
    matrix.grad, vector.grad = torch.randn_like(matrix), torch.randn_like(vector)
    from benchmarks.optimizer_step import MUON_KWARGS

    ShardedMuon.from_keywords([matrix], fp32_matmul_prec=MUON_KWARGS["fp32_matmul_prec"]).step()
    torch.optim.AdamW([vector]).step()


def training_step_memory(rank: int, world_size: int, device: str, size: GPTSize, kind: str) -> dict:
    """Peak memory of a training step with one optimizer kind (its own process: no other state).

    Returns bytes: ``before_model`` (process after start-up), ``before_step`` (model, grads and
    optimizer state of a warmed-up step in place) and ``step_peak`` (peak during the next step).
    """
    if device == "cpu":
        return_freed_memory_to_os()
    _load_step_kernels(device)
    probe = MemoryProbe(device)
    before_model = probe.current()
    trainer = Trainer(size, world_size, device, kind)
    trainer.timed_step()  # a first step, as in training: every buffer exists
    dist.barrier()
    probe.start()
    trainer.timed_step()
    return {
        "before_model": before_model,
        "before_step": probe.baseline,
        "step_peak": probe.peak(),
    }


def training_step_section(config: BenchConfig, device: str) -> dict:
    """Section 2: Muon vs AdamW whole step and optimizer step (slowest rank's medians)."""
    size, dp = config.gpt, config.train_dp
    results = run_ranks(muon_vs_adamw_step, dp, device, size, config.warmup, config.repeats)
    muon = {k: max(r["muon"][k] for r in results) for k in ("step_s", "optimizer_s")}
    adamw = {k: max(r["adamw"][k] for r in results) for k in ("step_s", "optimizer_s")}
    timing = {
        "model": asdict(size),
        "dp": dp,
        "strategy": "optim_grads_params",
        "optimizers": {
            "muon": "megatron_muon.build_muon_optimizer: ShardedMuon (owner) for 2-D hidden "
            "weights + AdamW for the rest, grad clipping 1.0",
            "adamw": "megatron-core get_megatron_optimizer(optimizer='adam'): "
            "DistributedOptimizer, grad clipping 1.0",
        },
        "tokens_per_rank": size.tokens_per_rank(),
        "muon_step_s": muon["step_s"],
        "adamw_step_s": adamw["step_s"],
        "muon_over_adamw_step": muon["step_s"] / adamw["step_s"],
        "muon_optimizer_s": muon["optimizer_s"],
        "adamw_optimizer_s": adamw["optimizer_s"],
        "muon_over_adamw_optimizer": muon["optimizer_s"] / adamw["optimizer_s"],
        "muon_ns_flops_max": max(r["muon_ns_flops"] for r in results),
        "anchor": ANCHOR,
    }
    return timing


def report_lines(results: dict) -> list[str]:
    """Section 2 in the terminal table."""
    t = results["training_step"]
    return [
        f"2. Training step, Muon vs AdamW (GPTModel, Megatron-FSDP {t['strategy']}, DP={t['dp']}, "
        f"{t['tokens_per_rank']} tokens/rank)",
        f"   whole step: Muon {t['muon_step_s']:.3f} s, AdamW {t['adamw_step_s']:.3f} s, "
        f"Muon/AdamW {t['muon_over_adamw_step']:.2f}x",
        f"   optimizer step: Muon {t['muon_optimizer_s']:.3f} s, AdamW "
        f"{t['adamw_optimizer_s']:.3f} s, Muon/AdamW {t['muon_over_adamw_optimizer']:.2f}x",
        f"   anchor: {t['anchor']}",
        "",
    ]


def markdown_lines(results: dict) -> list[str]:
    """Section 2 as Markdown."""
    t = results["training_step"]
    out = [
        f"**2. Training step, Muon vs AdamW** (GPTModel {t['model']['num_layers']} layers, "
        f"hidden {t['model']['hidden']}, FFN {t['model']['ffn_hidden']}, "
        f"vocab {t['model']['vocab_size']}; "
        f"Megatron-FSDP {t['strategy']}, DP={t['dp']}, {t['tokens_per_rank']} tokens per rank)",
        "",
    ]
    out += table(
        ["", "Muon s", "AdamW s", "Muon/AdamW"],
        [
            [
                "whole step",
                f"{t['muon_step_s']:.3f}",
                f"{t['adamw_step_s']:.3f}",
                f"**{t['muon_over_adamw_step']:.2f}x**",
            ],
            [
                "optimizer step",
                f"{t['muon_optimizer_s']:.3f}",
                f"{t['adamw_optimizer_s']:.3f}",
                f"**{t['muon_over_adamw_optimizer']:.2f}x**",
            ],
        ],
    )
    return out


def _run(context: RunContext, results: dict) -> dict:
    return training_step_section(context.config, context.device)


SECTION = Section(
    key="training_step",
    run=_run,
    figures=tuple(
        f"training_step.{figure}"
        for figure in (
            "muon_step_s",
            "adamw_step_s",
            "muon_over_adamw_step",
            "muon_optimizer_s",
            "adamw_optimizer_s",
            "muon_over_adamw_optimizer",
        )
    ),
    report=report_lines,
    markdown=markdown_lines,
)

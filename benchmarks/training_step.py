"""Full training-step benchmarks (run inside ranks): Muon vs AdamW on a Megatron-FSDP GPTModel.

The model is a megatron-core ``GPTModel`` (local layer spec) wrapped with megatron-core's
``FullyShardedDataParallel`` (Megatron-FSDP, ``optim_grads_params``). One training step is
``zero_grad_buffer`` -> forward -> backward -> ``finish_grad_sync`` -> optimizer step -> install the
updated weights into the compute weights (what megatron-core's DistributedOptimizer does for
Megatron-FSDP); the *optimizer step* is the last two.

Optimizers compared, on the same model and sharding:
- ``muon``: ``ShardedMuon`` (owner mode) for the 2-D hidden weights (Megatron's routing: every 2-D
  param that is not an embedding or output layer) + ``torch.optim.AdamW`` for the rest;
- ``adamw``: ``torch.optim.AdamW`` for every param.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.measure import MemoryProbe, median, return_freed_memory_to_os, timed
from benchmarks.optimizer_step import MUON_KWARGS

__all__ = ["GPTSize", "muon_vs_adamw_step", "training_step_memory"]

_ADAMW_KWARGS = dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


@dataclass(frozen=True, slots=True)
class GPTSize:
    """GPTModel size and the tokens each rank processes per step."""

    num_layers: int
    hidden: int
    ffn_hidden: int
    num_heads: int
    vocab_size: int
    seq_length: int
    micro_batch: int

    def tokens_per_rank(self) -> int:
        return self.seq_length * self.micro_batch


class _Trainer:
    """A wrapped GPTModel, its batch, and the optimizers to compare on it."""

    def __init__(self, size: GPTSize, world_size: int, device: str) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallelConfig,
            FullyShardedDataParallel,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig

        self.device = device
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
            bf16=device == "cuda",
            params_dtype=torch.bfloat16 if device == "cuda" else torch.float32,
        )
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=size.vocab_size,
            max_sequence_length=size.seq_length,
        )
        ddp_config = DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params",
            use_megatron_fsdp=True,
            gradient_reduce_div_fusion=False,
        )
        self.wrapped = FullyShardedDataParallel(
            config, ddp_config, model, device=torch.device(device)
        )
        # The optimizer params: the Shard(0) DTensors, taken right after wrapping.
        self.named_params = list(self.wrapped.named_parameters())
        generator = torch.Generator().manual_seed(100 + dist.get_rank())
        shape = (size.micro_batch, size.seq_length)
        self.tokens = torch.randint(0, size.vocab_size, shape, generator=generator).to(device)
        self.labels = torch.randint(0, size.vocab_size, shape, generator=generator).to(device)
        self.positions = torch.arange(size.seq_length, device=device).expand(shape)
        # Megatron's convention: True = masked out (causal: keys after the query).
        ones = torch.ones(size.seq_length, size.seq_length, dtype=torch.bool, device=device)
        self.causal_mask = torch.triu(ones, diagonal=1)[None, None]
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)

    def muon_params(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(Muon params, AdamW params) by Megatron's routing rule."""
        muon, rest = [], []
        for name, p in self.named_params:
            is_embedding = getattr(p, "is_embedding_or_output_parameter", False) or (
                "embedding" in name or "output_layer" in name
            )
            (muon if p.ndim == 2 and not is_embedding else rest).append(p)
        return muon, rest

    def optimizers(self, kind: str) -> list[torch.optim.Optimizer]:
        from megatron_muon import ShardedMuon

        if kind == "adamw":
            return [torch.optim.AdamW([p for _, p in self.named_params], **_ADAMW_KWARGS)]
        if kind == "muon":
            muon, rest = self.muon_params()
            return [
                ShardedMuon(muon, dp_group=self.dp_group, mode="owner", **MUON_KWARGS),
                torch.optim.AdamW(rest, **_ADAMW_KWARGS),
            ]
        raise ValueError(f"unknown optimizer kind {kind!r}; expected 'muon' or 'adamw'")

    def forward_backward(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.wrapped.zero_grad_buffer()
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = self.wrapped(
            input_ids=self.tokens,
            position_ids=self.positions,
            attention_mask=self.causal_mask,
            labels=self.labels,
        )
        loss.float().mean().backward()
        self.wrapped.finish_grad_sync()

    def optimizer_step(self, optimizers: list[torch.optim.Optimizer]) -> None:
        for optimizer in optimizers:
            optimizer.step()
        self.wrapped.module.install_optimized_model_weights()

    def timed_step(self, optimizers: list[torch.optim.Optimizer]) -> tuple[float, float]:
        """(whole step seconds, optimizer-step seconds), each between barriers."""
        whole = timed(lambda: self.forward_backward(optimizers), self.device)
        optimizer = timed(lambda: self.optimizer_step(optimizers), self.device)
        return whole + optimizer, optimizer


def muon_vs_adamw_step(
    rank: int, world_size: int, device: str, size: GPTSize, warmup: int, repeats: int
) -> dict:
    """Median whole-step and optimizer-step seconds of Muon and AdamW, alternating step by step."""
    trainer = _Trainer(size, world_size, device)
    kinds = {kind: trainer.optimizers(kind) for kind in ("muon", "adamw")}
    for _ in range(warmup):
        for optimizers in kinds.values():
            trainer.timed_step(optimizers)
    samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    names = list(kinds)
    for round_index in range(repeats):
        shift = round_index % len(names)
        for kind in names[shift:] + names[:shift]:
            samples[kind].append(trainer.timed_step(kinds[kind]))
    muon_stats = kinds["muon"][0].step_stats
    return {
        kind: {
            "step_s": median([whole for whole, _ in values]),
            "optimizer_s": median([opt for _, opt in values]),
        }
        for kind, values in samples.items()
    } | {"muon_ns_flops": muon_stats.ns_flops, "muon_bytes_sent": muon_stats.bytes_sent}


def _load_step_kernels(device: str) -> None:
    """One tiny Muon and AdamW step, so that one-time costs (kernel code, library state) land in
    the start-up level for both optimizer kinds alike, not in one kind's step."""
    from megatron_muon import ShardedMuon

    matrix = torch.nn.Parameter(torch.randn(64, 128, device=device))
    vector = torch.nn.Parameter(torch.randn(64, device=device))
    matrix.grad, vector.grad = torch.randn_like(matrix), torch.randn_like(vector)
    ShardedMuon([matrix], **MUON_KWARGS).step()
    torch.optim.AdamW([vector], **_ADAMW_KWARGS).step()


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
    trainer = _Trainer(size, world_size, device)
    optimizers = trainer.optimizers(kind)
    trainer.timed_step(optimizers)  # creates AdamW's lazy state
    dist.barrier()
    probe.start()
    trainer.timed_step(optimizers)
    return {
        "before_model": before_model,
        "before_step": probe.baseline,
        "step_peak": probe.peak(),
    }

"""Megatron-Bridge pretraining with megatron-muon's Muon on Megatron-FSDP: the one line.

A Bridge recipe's ``ConfigContainer`` trains Muon on Megatron-FSDP once its optimizer config is
megatron-muon's (docs/megatron_bridge.md)::

    cfg.optimizer = MuonFsdpOptimizerConfig.from_config(cfg.optimizer)

``tiny_gpt_config`` is a recipe of that kind, small enough for CPU ranks (2 layers, hidden 64, mock
data, the local layer spec); a real recipe (``megatron.bridge.recipes...``) takes the same line.
Run it with ``torchrun --nproc-per-node 2 examples/bridge_pretrain_gpt.py --optimizer muon``
(``--optimizer dist_muon`` is the name Bridge's Muon recipes use: the same Muon here;
``adaptive_muon`` and ``lion`` are megatron-muon's other optimizers, at megatron-core's default
settings); without a GPU, from ``make test-bridge``'s environment (``.venv-bridge``: Bridge
imports Transformer Engine, which that environment stands in for).
"""

from __future__ import annotations

import argparse
from typing import Any, get_args

import torch
from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
from megatron.bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DistributedDataParallelConfig,
    DistributedInitConfig,
    LoggerConfig,
    MockGPTDatasetConfig,
    OptimizerConfig,
    RNGConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
)

SEQ_LENGTH = 64
# Megatron-FSDP's data_parallel_sharding_strategy values (Megatron's
# --data-parallel-sharding-strategy choices).
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
VOCAB_SIZE = 256


def tiny_gpt_model() -> GPTModelProvider:
    """A 2-layer GPT (hidden 64, 4 heads) in fp32 with the local (non-TE) spec, no fusions."""
    return GPTModelProvider(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        seq_length=SEQ_LENGTH,
        vocab_size=VOCAB_SIZE,
        make_vocab_size_divisible_by=128,
        share_embeddings_and_output_weights=False,
        transformer_layer_spec=local_layer_spec,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=False,
        params_dtype=torch.float32,
        use_cpu_initialization=not torch.cuda.is_available(),
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        persist_layer_norm=False,
    )


def tiny_gpt_optimizer(optimizer: str) -> OptimizerConfig:
    """Bridge's own optimizer config, as a recipe writes it (fp32 Newton-Schulz matmuls)."""
    return OptimizerConfig(
        optimizer=optimizer,
        lr=1e-2,
        min_lr=1e-3,
        weight_decay=0.01,
        clip_grad=1.0,
        bf16=False,
        fp16=False,
        use_distributed_optimizer=True,
        muon_fp32_matmul_prec="highest",
    )


def tiny_gpt_config(
    optimizer: OptimizerConfig,
    *,
    data_parallel_sharding_strategy: str = "optim_grads_params",
    train_iters: int = 6,
    exit_interval: int | None = None,
    save: str | None = None,
    save_interval: int | None = None,
    load: str | None = None,
    ckpt_step: int | None = None,
) -> ConfigContainer:
    """The recipe: ``optimizer`` on the tiny GPT under Megatron-FSDP, ``fsdp_dtensor`` checkpoints.

    Global batch 8 in micro-batches of 2, cosine decay over ``train_iters`` after one warm-up
    iteration, gloo without a GPU (nccl with one).
    """
    return ConfigContainer(
        model=tiny_gpt_model(),
        train=TrainingConfig(
            train_iters=train_iters,
            exit_interval=exit_interval,
            global_batch_size=8,
            micro_batch_size=2,
            eval_interval=1000,
            eval_iters=0,
        ),
        optimizer=optimizer,
        scheduler=SchedulerConfig(
            lr_decay_style="cosine",
            lr_warmup_iters=1,
            lr_decay_iters=train_iters,
            start_weight_decay=0.01,
            end_weight_decay=0.01,
            weight_decay_incr_style="constant",
        ),
        ddp=DistributedDataParallelConfig(
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy=data_parallel_sharding_strategy,
            use_distributed_optimizer=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            grad_reduce_in_fp32=True,
        ),
        dist=DistributedInitConfig(
            distributed_backend="nccl" if torch.cuda.is_available() else "gloo",
            use_gloo_process_groups=False,
        ),
        dataset=MockGPTDatasetConfig(
            seq_length=SEQ_LENGTH,
            random_seed=1234,
            reset_attention_mask=False,
            reset_position_ids=False,
            eod_mask_loss=False,
            num_dataset_builder_threads=1,
            data_sharding=True,
            dataloader_type="single",
            num_workers=0,
        ),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB_SIZE),
        checkpoint=CheckpointConfig(
            save=save,
            save_interval=save_interval,
            load=load,
            ckpt_step=ckpt_step,
            ckpt_format="fsdp_dtensor",
        ),
        rng=RNGConfig(seed=1234),
    )


def main(argv: list[str] | None = None) -> None:
    """Parses the flags below, applies the one line and runs Bridge's ``pretrain``."""
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from megatron_muon.common.options import FsdpOptimizerT
    from megatron_muon.integrations.megatron_bridge import MuonFsdpOptimizerConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    optimizers = [*get_args(FsdpOptimizerT), "dist_muon", "adam"]
    parser.add_argument("--optimizer", default="muon", choices=optimizers)
    parser.add_argument(
        "--data-parallel-sharding-strategy",
        default="optim_grads_params",
        choices=SHARDING_STRATEGIES,
    )
    parser.add_argument("--train-iters", type=int, default=6)
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    args = parser.parse_args(argv)
    cfg = tiny_gpt_config(
        tiny_gpt_optimizer(args.optimizer),
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
        train_iters=args.train_iters,
        save=args.save,
        save_interval=args.train_iters if args.save else None,
        load=args.load,
    )
    cfg.optimizer = MuonFsdpOptimizerConfig.from_config(cfg.optimizer)  # the one line
    run: Any = pretrain
    run(cfg, forward_step)


if __name__ == "__main__":
    main()

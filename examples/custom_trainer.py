"""A custom training loop that uses megatron-muon's factory directly (no Megatron-LM CLI).

A megatron-core ``GPTModel`` wrapped by Megatron-FSDP (megatron-core ``FullyShardedDataParallel``),
chained Muon (2-D hidden weights, ``ShardedMuon`` over ``dp_cp``) and AdamW (embeddings, output
layer, biases, norms) from ``build_muon_optimizer``, trained on the embedded real text. The step
wrapper the factory returns reduces the gradients once, whatever the backward did
(``megatron_muon.fsdp.grad_sync``; this loop does not reduce them itself:
``grads_already_synced=False``), clips, steps both optimizers, installs the new weights and starts
the parameter sync.

Run on 2 processes (CPU/gloo without a GPU, NCCL with one)::

    torchrun --nproc-per-node 2 examples/custom_trainer.py --steps 20
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def build_model(seq_length: int) -> torch.nn.Module:
    """A small GPTModel (local layer spec, byte vocabulary), same weights on every rank."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=seq_length
    )


def train(steps: int = 20, seq_length: int = 64, micro_batch: int = 4, lr: float = 0.01) -> list:
    """Trains on this process's rank; returns the per-step mean loss over the data-parallel group.

    Needs ``torch.distributed`` initialised (gloo on CPU, NCCL on GPUs).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig

    from megatron_muon import MuonFsdpConfig, build_muon_optimizer
    from megatron_muon.cli.data import ByteTextDataset, load_text_splits

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()

    model = build_model(seq_length)
    ddp_config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params",
        use_megatron_fsdp=True,
        gradient_reduce_div_fusion=on_gpu,  # PREMUL_SUM is NCCL-only
    )
    model = FullyShardedDataParallel(model.config, ddp_config, model, device=device)
    optimizer = build_muon_optimizer(
        OptimizerConfig(optimizer="muon", lr=lr, min_lr=lr, weight_decay=0.01, clip_grad=1.0),
        [model],
        fsdp_config=MuonFsdpConfig(mode="owner"),
    )

    data = ByteTextDataset(load_text_splits(max_bytes=2**20).train, seq_length)
    positions = torch.arange(seq_length, device=device).expand(micro_batch, seq_length)
    causal = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), 1)
    losses = []
    for step in range(steps):
        samples = [data[(step * world + rank) * micro_batch + i] for i in range(micro_batch)]
        tokens = torch.stack([s["tokens"] for s in samples]).to(device)
        labels = torch.stack([s["labels"] for s in samples]).to(device)
        optimizer.zero_grad()
        loss = (
            model(
                input_ids=tokens,
                position_ids=positions,
                attention_mask=causal[None, None],
                labels=labels,
            )
            .float()
            .mean()
        )
        loss.backward()
        ok, grad_norm, _ = optimizer.step()  # reduce grads once, step, install weights
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(float(mean_loss) / world)
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}  grad norm {float(grad_norm):.3f}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        from megatron_muon import cpu_stand_ins

        cpu_stand_ins.install()
    try:
        train(args.steps, lr=args.lr)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A custom training loop that uses megatron-muon's factory directly (no Megatron-LM CLI).

A megatron-core ``GPTModel`` wrapped by Megatron-FSDP (megatron-core ``FullyShardedDataParallel``),
chained Muon (2-D hidden weights, ``ShardedMuon`` over ``dp_cp``) and AdamW (embeddings, output
layer, biases, norms) from ``build_muon_optimizer``, trained on the embedded real text. The step
wrapper the factory returns reduces the gradients once, whatever the backward did
(``megatron_muon.fsdp.grad_sync``; this loop does not reduce them itself:
``grads_already_synced=False``), clips, steps both optimizers, installs the new weights and starts
the parameter sync.

With ``--save DIR`` it checkpoints every ``--save-interval`` steps (``megatron_muon.checkpointing``:
``DIR/step_<n>``, whole or not at all) and starts from the latest complete one in ``DIR``, so that
``torchrun --max-restarts`` resumes a run whose rank died, losing at most the interval: the process
group comes up through ``megatron_muon.integrations.restart_store.init_process_group``, on a store
prefix of its own per torchrun attempt (torch's own ``init_process_group`` would find the dead
attempt's keys in torchrun's store and hang or fail).

Run on 2 processes (CPU/gloo without a GPU, NCCL with one)::

    torchrun --nproc-per-node 2 --max-restarts 1 examples/custom_trainer.py --steps 20 \
        --save /tmp/custom_ckpt --save-interval 5
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

# Called after every step on every rank: (steps done, the step's mean loss, its grad norm).
StepCallback = Callable[[int, float, float], None]


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


def latest_checkpoint(save_dir: str) -> str | None:
    """The complete ``step_<n>`` checkpoint of ``save_dir`` with the largest n, or None.

    A save that did not finish left ``step_<n>.incomplete`` (no completion marker): never taken.
    """
    from megatron_muon.checkpointing import MARKER_NAME

    if not os.path.isdir(save_dir):
        return None
    steps = [
        int(match.group(1))
        for name in os.listdir(save_dir)
        if (match := re.fullmatch(r"step_(\d+)", name))
        and os.path.isfile(os.path.join(save_dir, name, MARKER_NAME))
    ]
    return os.path.join(save_dir, f"step_{max(steps):06d}") if steps else None


def train(
    steps: int = 20,
    seq_length: int = 64,
    micro_batch: int = 4,
    lr: float = 0.01,
    *,
    save: str | None = None,
    save_interval: int = 0,
    on_step: StepCallback | None = None,
) -> list:
    """Trains on this process's rank; returns the per-step mean loss over the data-parallel group.

    Needs ``torch.distributed`` initialised (gloo on CPU, NCCL on GPUs). With ``save``, resumes from
    ``latest_checkpoint(save)`` (model, optimizer, RNG; the data position is the step count) and
    saves every ``save_interval`` steps; the losses returned are those of the steps run here.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig

    from megatron_muon import MuonFsdpConfig, build_muon_optimizer, load_checkpoint, save_checkpoint
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

    start = 0
    resume_from = latest_checkpoint(save) if save else None
    if resume_from is not None:
        start = load_checkpoint(resume_from, [model], optimizer).iteration
        if rank == 0:
            print(f"resumed from {resume_from} (step {start})")

    data = ByteTextDataset(load_text_splits(max_bytes=2**20).train, seq_length)
    positions = torch.arange(seq_length, device=device).expand(micro_batch, seq_length)
    causal = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), 1)
    losses = []
    for step in range(start, steps):
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
        if on_step is not None:
            on_step(step + 1, losses[-1], float(grad_norm))
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}  grad norm {float(grad_norm):.3f}")
        if save and save_interval and (step + 1) % save_interval == 0:
            save_checkpoint(
                os.path.join(save, f"step_{step + 1:06d}"), [model], optimizer, iteration=step + 1
            )
    return losses


def main(argv: Sequence[str] | None = None, on_step: StepCallback | None = None) -> None:
    from megatron_muon.integrations.restart_store import init_process_group

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--save", help="checkpoint directory: resume from it, save into it")
    parser.add_argument("--save-interval", type=int, default=0, help="steps between saves")
    args = parser.parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    init_process_group(backend)  # torch's, on a store prefix of this torchrun attempt
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        from megatron_muon import cpu_stand_ins

        cpu_stand_ins.install()
    try:
        train(
            args.steps,
            args.seq_length,
            lr=args.lr,
            save=args.save,
            save_interval=args.save_interval,
            on_step=on_step,
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

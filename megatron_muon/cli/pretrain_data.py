"""The pretrain entry point's data and forward step, as Megatron-LM's ``pretrain_gpt.py`` has them.

- ``datasets_provider``: the embedded byte-level text (``megatron_muon.cli.data``; ``--text-path``
  for a file of the user's), training windows in a random order (``--seed``), validated on a fixed
  set of ``eval_iters * eval_global_batch_size`` held-out sequences; or Megatron's datasets
  (``--mock-data``, or indexed ``--data-path``).
- ``get_batch``: TP rank 0 reads each micro-batch, megatron-core's ``get_batch_on_this_tp_rank``
  broadcasts it over the tensor-parallel group.
- ``loss_func`` / ``forward_step``: the summed token loss, checked for NaN, Inf and spikes through
  Megatron's rerun state machine, as Megatron-LM's ``pretrain_gpt.py`` checks it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

__all__ = ["datasets_provider", "get_batch", "loss_func", "forward_step", "SPIKY_LOSS_FACTOR"]


def _uses_byte_data(args: argparse.Namespace) -> bool:
    return not (args.mock_data or args.data_path or args.train_data_path)


def datasets_provider(num_samples: Sequence[int], vp_stage: int | None = None) -> tuple:
    """Train / validation / test datasets: embedded bytes, or Megatron's (mock or indexed)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    from megatron_muon.cli.data import ByteTextDataset, load_text_splits

    args = get_args()
    if _uses_byte_data(args):
        splits = load_text_splits(args.text_path)
        train = ByteTextDataset(
            splits.train, args.seq_length, max(1, num_samples[0]), shuffle_seed=args.seed
        )
        # Every evaluation reads the same sequences (ByteTextDataset's fixed_windows says why).
        per_evaluation = max(1, args.eval_iters * args.eval_global_batch_size)
        valid = ByteTextDataset(
            splits.valid, args.seq_length, max(1, num_samples[1]), fixed_windows=per_evaluation
        )
        print_rank_0(
            f"> byte-level data: {splits.source}: {splits.train.numel():,} training and "
            f"{splits.valid.numel():,} validation tokens; each evaluation reads the same "
            f"{valid.num_windows} validation sequences, spread over the held-out files"
        )
        return train, valid, None
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, num_samples, lambda: True, config).build()


def get_batch(data_iterator: Any) -> tuple[torch.Tensor | None, ...]:
    """The next micro-batch on this rank: read on TP rank 0, broadcast over the TP group (PP = 1).

    Returns ``(tokens, labels, loss_mask, attention_mask, position_ids)``: each
    ``[micro_batch_size, seq_length]`` but ``attention_mask``, which is None unless the data loader
    builds one (``[micro_batch_size, 1, seq_length, seq_length]``).
    """
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_tp_rank
    from megatron.training import get_args

    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict[str, Any] = {}
    if tp_rank == 0:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        batch = {
            k: (v.to(device) if v is not None else None) for k, v in next(data_iterator).items()
        }
        batch.setdefault("attention_mask", None)
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=1,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
    )
    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    return tuple(batch.get(key) for key in keys)


# A loss this many times the largest one seen so far is "spiky" (Megatron-LM's pretrain_gpt.py).
SPIKY_LOSS_FACTOR = 10


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple:
    """This rank's summed token loss, its token count and the report, checked as Megatron-LM does.

    As in Megatron-LM's ``pretrain_gpt.py``: with ``--check-for-nan-in-loss-and-grad`` (Megatron's
    default) a NaN or Inf local loss fails validation in Megatron's rerun state machine (fatal:
    Megatron reruns the step to attribute the fault, then stops the run); with
    ``--check-for-spiky-loss`` a loss ``SPIKY_LOSS_FACTOR`` times the largest so far is reported.
    """
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])

    args = get_args()
    rerun_state_machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for rejection_func, kind in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun_state_machine.validate_result(
                result=loss,
                rejection_func=rejection_func,
                message=f"found {kind} in local forward loss calculation",
                tolerance=0.0,  # the forward is deterministic
                fatal=True,
            )
    if args.check_for_spiky_loss:
        rerun_state_machine.validate_result(
            result=loss,
            rejection_func=partial(
                rerun_state_machine.is_unexpectedly_large,
                threshold=SPIKY_LOSS_FACTOR,
                context="loss",
            ),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Any, model: Any) -> tuple:
    """One micro-batch forward; Megatron's schedule reduces the returned loss."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    assert loss_mask is not None  # only attention_mask may be None (get_batch)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)

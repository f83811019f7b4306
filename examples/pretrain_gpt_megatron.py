from megatron_muon.integrations.megatron_lm import install; install()  # noqa: E702, I001  # fmt: skip
# ruff: noqa: E402  (install() must run before anything imports megatron.training)
#
# GPT pretraining in Megatron-LM's own loop, with ``--optimizer muon --use-megatron-fsdp``.
#
# Our minimal equivalent of Megatron-LM's ``pretrain_gpt.py``: the model comes from Megatron's GPT
# builder (``gpt_config_from_args``), the data from Megatron's ``BlendedMegatronDatasetBuilder``
# (``--mock-data``, or a user's indexed dataset via ``--data-path``), and training is
# ``megatron.training.pretrain``. The only megatron-muon line is the first one: ``install()`` (see
# ``megatron_muon.integrations.megatron_lm``). Batches are built as Megatron-LM's ``get_batch``
# builds them. Tensor (every ``--muon-tp-mode``), expert and data parallelism (HSDP too); no
# pipeline parallelism (megatron-core 0.19.2's Megatron-FSDP cannot wrap a pipeline stage) and no
# context parallelism (it needs Transformer Engine's attention): see docs/parallelism.md.
#
# Two CPU ranks (gloo), tiny GPT, mock data::
#
#     torchrun --nproc-per-node 2 examples/pretrain_gpt_megatron.py \
#         --optimizer muon --use-megatron-fsdp --ckpt-format fsdp_dtensor \
#         --data-parallel-sharding-strategy optim_grads_params --distributed-backend gloo \
#         --use-cpu-initialization --transformer-impl local --no-gradient-accumulation-fusion \
#         --no-gradient-reduce-div-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion \
#         --no-masked-softmax-fusion --no-rope-fusion --no-persist-layer-norm \
#         --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
#         --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 \
#         --train-iters 5 --lr 0.02 --lr-decay-style constant \
#         --hidden-dropout 0 --attention-dropout 0 --mock-data --tokenizer-type NullTokenizer \
#         --vocab-size 128 --log-interval 1 --eval-iters 0 --eval-interval 1000

from functools import partial

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.parallel_state import (
    get_context_parallel_group,
    get_hybrid_data_context_parallel_groups,
)
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.utils import (
    flatten_batch_for_packed_sequences,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training import get_args, get_timers, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split

# The keys Megatron-LM's pretrain_gpt.py moves and broadcasts (its BATCH_KEYS, alphabetical).
_BATCH_KEYS = (
    "attention_mask",
    "cu_seqlens",
    "cu_seqlens_padded",
    "hybrid_cp_group",
    "labels",
    "local_cp_size",
    "loss_mask",
    "max_seqlen",
    "position_ids",
    "tokens",
)
_MODEL_INPUTS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator) -> tuple[torch.Tensor | None, ...]:
    """The next micro-batch, built as Megatron-LM's ``pretrain_gpt.get_batch`` builds it (PP = 1).

    TP rank 0 reads the batch and moves it with ``.cuda(non_blocking=True)`` (without a GPU the
    CPU stand-ins keep it on the CPU); megatron-core's ``get_batch_on_this_tp_rank`` broadcasts
    it over the TP group, then ``flatten_batch_for_packed_sequences`` and
    ``get_batch_on_this_cp_rank``, as in Megatron-LM's script.
    """
    args = get_args()
    batch: dict = {}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    if tp_rank == 0:
        batch = next(data_iterator)
        for key in _BATCH_KEYS:
            value = batch.get(key)
            batch[key] = value.cuda(non_blocking=True) if value is not None else None
    batch = get_batch_on_this_tp_rank(
        batch,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
    )
    batch = flatten_batch_for_packed_sequences(batch)
    batch = get_batch_on_this_cp_rank(
        batch,
        is_hybrid_cp=False,
        cp_group=get_context_parallel_group(),
        hybrid_cp_group_func=get_hybrid_data_context_parallel_groups,
    )
    return tuple(batch.get(key) for key in _MODEL_INPUTS)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed token loss, the number of tokens, and the report Megatron averages over DP."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """One forward pass; returns the per-token losses and the function that reduces them."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def dataset_config(args) -> GPTDatasetConfig:
    """Megatron's GPT dataset config from the parsed flags (mock or indexed data)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
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


def train_valid_test_datasets_provider(num_samples, vp_stage=None):
    """Train/valid/test datasets, built on TP rank 0 (the rank that reads batches)."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(
        dataset_type,
        num_samples,
        lambda: mpu.get_tensor_model_parallel_rank() == 0,
        dataset_config(args),
    ).build()


def main() -> None:
    """Parse Megatron's flags (ours are added by ``install()``), build the config, train."""
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    if args.pipeline_model_parallel_size > 1 or args.context_parallel_size > 1:
        raise ValueError(
            "this example supports tensor, expert and data parallelism only: "
            "--pipeline-model-parallel-size and --context-parallel-size must be 1"
        )
    train_valid_test_datasets_provider.is_distributed = True
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()

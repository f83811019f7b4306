"""A ``--load`` whose vocabulary padding differs from this run's: refused before anything loads.

An ``fsdp_dtensor`` checkpoint holds every tensor whole (TP shards as whole matrices, experts by
global index), so loading it at another tensor- or expert-parallel size works (measured in
Megatron-LM's loop: TP = 2 x EP = 2 on 4 ranks into 1 rank, every later grad norm and loss equal;
tests/test_megatron_lm_moe_tensor_parallel.py). One shape depends on TP itself: Megatron pads the
vocabulary to a multiple of ``--make-vocab-size-divisible-by`` x ``--tensor-model-parallel-size``
(``vocab_size_with_padding``), so a checkpoint saved at TP = 2 holds 256 embedding rows for a
vocabulary of 128 and a TP = 1 run expects 128. Stock megatron-core 0.19.2 then stops inside the
load with ``Size mismatch ... [256, 64] vs [128, 64] for embedding.word_embeddings.weight``.

``check_vocab_padding`` compares the rows of the checkpoint's word embedding and output layer (its
DCP metadata, read by every rank alike) with this run's ``args.padded_vocab_size`` and raises
``CheckpointMismatchError`` naming both sizes, both TP sizes' part in it, and the
``--make-vocab-size-divisible-by`` value that makes this run pad as the checkpoint did.
``megatron_lm.install()`` runs it before Megatron's ``load_checkpoint`` for ``fsdp_dtensor``
checkpoints.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

from megatron_muon.checkpointing import CheckpointMismatchError
from megatron_muon.integrations.checkpoint_guards.load_directory import checkpoint_directory

__all__ = ["check_vocab_padding", "checking_vocab_padding_first", "divisors_padding_to"]

_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def divisors_padding_to(vocab_size: int, rows: int, tensor_parallel_size: int) -> list[int]:
    """The ``--make-vocab-size-divisible-by`` values that pad ``vocab_size`` to ``rows`` at this
    tensor-parallel size (Megatron: up to a multiple of the value x TP), smallest first."""
    return [
        divisor
        for divisor in range(1, rows // tensor_parallel_size + 1)
        if math.ceil(vocab_size / (divisor * tensor_parallel_size))
        * (divisor * tensor_parallel_size)
        == rows
    ]


def _saved_vocab_rows(directory: str) -> dict[str, int]:
    """{checkpoint key: rows} of the word embedding and output layer in a DCP checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(directory).read_metadata().state_dict_metadata
    rows = {}
    for key, item in metadata.items():
        size = getattr(item, "size", None)
        if key.startswith("model.") and key.endswith(_VOCAB_KEYS) and size is not None and size:
            rows[key] = int(size[0])
    return rows


def _original_vocab_size(args: Any) -> int | None:
    if getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    try:
        from megatron.training import get_tokenizer

        return int(get_tokenizer().vocab_size)
    except Exception:  # noqa: BLE001  (no tokenizer built: the message says less)
        return None


def check_vocab_padding(args: Any) -> None:
    """Raises when the checkpoint ``--load`` reads pads the vocabulary to another size.

    Raises:
        CheckpointMismatchError: names the saved and expected rows and the flag that avoids it.
    """
    expected = getattr(args, "padded_vocab_size", None)
    if getattr(args, "ckpt_format", None) != "fsdp_dtensor" or not expected:
        return
    directory = checkpoint_directory(args)
    if directory is None or not os.path.isfile(os.path.join(directory, ".metadata")):
        return  # Megatron's own load reports a missing checkpoint
    differing = {k: rows for k, rows in _saved_vocab_rows(directory).items() if rows != expected}
    if not differing:
        return
    saved = next(iter(differing.values()))
    tp, divisible_by = args.tensor_model_parallel_size, args.make_vocab_size_divisible_by
    vocab = _original_vocab_size(args)
    hint = ""
    if vocab is not None and (divisors := divisors_padding_to(vocab, saved, tp)):
        hint = f"; --make-vocab-size-divisible-by {divisors[-1]} makes this run pad to {saved}"
    raise CheckpointMismatchError(
        f"--load {args.load}: checkpoint {directory} holds a vocabulary padded to {saved} rows "
        f"({', '.join(sorted(differing))}), this run pads to {expected} (a multiple of "
        f"--make-vocab-size-divisible-by {divisible_by} x --tensor-model-parallel-size {tp}). "
        "Vocabulary padding follows the tensor-parallel size: load with the "
        "--make-vocab-size-divisible-by that pads as the saving run did"
        f"{hint} (and save with a value that pads alike at both sizes). Nothing was loaded"
    )


def checking_vocab_padding_first(load_checkpoint: Any) -> Any:
    """``load_checkpoint`` that first runs ``check_vocab_padding`` on Megatron's args."""

    @functools.wraps(load_checkpoint)
    def load_checkpoint_checked(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        check_vocab_padding(get_args())
        return load_checkpoint(*args, **kwargs)

    return load_checkpoint_checked

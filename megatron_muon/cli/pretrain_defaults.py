"""The pretrain entry point's defaults: a Muon run on Megatron-FSDP from model and run-length flags.

``python -m megatron_muon.pretrain --optimizer muon --num-layers 2 --hidden-size 64
--num-attention-heads 4 --seq-length 64 --micro-batch-size 4 --global-batch-size 8 --train-iters 40
--lr 0.02`` trains as it stands. ``default_flags`` finds which of the flags below the user (command
line or ``--config``) left unset, and returns those to put in front of the user's flags; the entry
point prints them once ("defaults applied: ...").

- ``--use-megatron-fsdp`` (the point of this package) and, with it, ``--ckpt-format
  fsdp_dtensor`` (the only format Megatron-FSDP saves). Opt out with ``--no-use-megatron-fsdp``,
  Megatron's spelling for turning off a flag that is on by default.
- ``--max-position-embeddings`` = ``--seq-length``.
- Evaluation about four times per run (``--eval-interval`` = a quarter of the run, at least 1) on
  ``--eval-iters 10`` batches; Megatron's own defaults (no interval, 100 batches) fail with a
  ``TypeError`` or take longer than a short run's training.
- ``--log-interval``: about ten progress lines per run, at most every 100 iterations (Megatron's
  default, 100, prints nothing in a 40-iteration run).
- With ``--save``, ``--save-interval`` = a quarter of the run (Megatron has none and fails at the
  end of training without one).
- Without a GPU, the CPU/gloo flags (``CPU_FLAGS``); on a GPU without Transformer Engine, the local
  transformer and no TE/Apex fusions (``NO_TE_FLAGS``: Megatron's default ``--transformer-impl
  transformer_engine`` fails to build there); with no data flag, the embedded byte-level
  text's tokenizer flags (``BYTE_DATA_FLAGS``).

Without a GPU, training without Megatron-FSDP is refused before anything starts: Megatron's DDP
places its buffers on CUDA ("Found no NVIDIA driver").
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = [
    "CPU_FLAGS",
    "NO_TE_FLAGS",
    "has_transformer_engine",
    "BYTE_DATA_FLAGS",
    "DATA_FLAGS",
    "add_opt_out_flags",
    "default_flags",
    "NO_MEGATRON_FSDP",
]

# What Megatron's loop needs without Transformer Engine (and Apex): the local transformer, none of
# the fusions those libraries provide. On a GPU they are the defaults when TE does not import.
NO_TE_FLAGS: list[tuple[str, ...]] = [
    ("--transformer-impl", "local"),
    ("--no-gradient-accumulation-fusion",),
    ("--no-gradient-reduce-div-fusion",),
    ("--no-bias-gelu-fusion",),
    ("--no-bias-dropout-fusion",),
    ("--no-masked-softmax-fusion",),
    ("--no-rope-fusion",),
    ("--no-persist-layer-norm",),
]
# What Megatron's loop needs on CPU/gloo: gloo, CPU initialization and the above.
CPU_FLAGS: list[tuple[str, ...]] = [
    ("--distributed-backend", "gloo"),
    ("--use-cpu-initialization",),
    *NO_TE_FLAGS,
]
# The embedded byte-level data (vocabulary 256, no attention mask from the data loader).
BYTE_DATA_FLAGS: list[tuple[str, ...]] = [
    ("--tokenizer-type", "NullTokenizer"),
    ("--vocab-size", "256"),
    ("--no-create-attention-mask-in-dataloader",),
]
# Any of these means the user brings Megatron data (mock or indexed), not the embedded text.
DATA_FLAGS = ("--mock-data", "--data-path", "--train-data-path")
NO_MEGATRON_FSDP = "--no-use-megatron-fsdp"
EVAL_ITERS = 10

_UNSET = object()  # a parser default that no command line can produce


def add_opt_out_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--no-use-megatron-fsdp``: the opt-out of the entry point's ``--use-megatron-fsdp``."""
    parser.add_argument(
        NO_MEGATRON_FSDP,
        dest="use_megatron_fsdp",
        action="store_false",
        help="Train without Megatron-FSDP (megatron_muon.pretrain turns --use-megatron-fsdp on "
        "by default; without a GPU this is refused).",
    )
    return parser


def has_transformer_engine() -> bool:
    """Whether ``transformer_engine.pytorch`` imports (looked up, not imported)."""
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def default_flags(
    parser: argparse.ArgumentParser,
    flags: Sequence[str],
    *,
    has_gpu: bool,
    has_te: bool = True,
) -> list[tuple[str, ...]]:
    """The entry point's defaults for what ``flags`` leave unset, each as ``(flag, *values)``.

    Args:
        parser: Megatron's parser with megatron-muon's and the entry point's flags (it is
            changed: the defaults of the flags looked at become a sentinel).
        flags: the user's flags (``--config``'s first, then the command line's).
        has_gpu: whether a CUDA device is present.
        has_te: whether Transformer Engine is installed (read only with a GPU).

    Raises:
        ValueError: no GPU and ``--no-use-megatron-fsdp`` (naming the flag).
    """
    device_flags = CPU_FLAGS if not has_gpu else ([] if has_te else NO_TE_FLAGS)
    optional = [*device_flags, *BYTE_DATA_FLAGS]
    dests = {option[0]: parser._option_string_actions[option[0]].dest for option in optional}
    run_dests: tuple[str, ...] = ("use_megatron_fsdp", "ckpt_format", "max_position_embeddings")
    run_dests += ("eval_interval", "eval_iters", "log_interval", "save_interval")
    parser.set_defaults(**{dest: _UNSET for dest in [*dests.values(), *run_dests]})
    given, _ = parser.parse_known_args(list(flags))

    def unset(dest: str) -> bool:
        return getattr(given, dest) is _UNSET

    defaults: list[tuple[str, ...]] = []
    defaults += [option for option in device_flags if unset(dests[option[0]])]
    if not any(flag.split("=")[0] in DATA_FLAGS for flag in flags):
        defaults += [option for option in BYTE_DATA_FLAGS if unset(dests[option[0]])]
    if unset("use_megatron_fsdp"):
        defaults.append(("--use-megatron-fsdp",))
    elif not given.use_megatron_fsdp and not has_gpu:
        raise ValueError(
            f"{NO_MEGATRON_FSDP} without a GPU: Megatron's DDP places its buffers on CUDA. "
            f"On CPU, megatron_muon.pretrain trains with Megatron-FSDP: drop {NO_MEGATRON_FSDP}."
        )
    if unset("ckpt_format") and given.use_megatron_fsdp is not False:
        defaults.append(("--ckpt-format", "fsdp_dtensor"))
    if unset("max_position_embeddings") and given.seq_length is not None:
        defaults.append(("--max-position-embeddings", str(given.seq_length)))
    defaults += _run_length_defaults(given, unset)
    return defaults


def _run_length_defaults(given: argparse.Namespace, unset) -> list[tuple[str, ...]]:
    """Evaluation and logging intervals from the run's length in iterations (when known)."""
    iterations = given.train_iters
    if iterations is None and given.train_samples and given.global_batch_size:
        iterations = given.train_samples // given.global_batch_size
    quarter = str(max(1, iterations // 4) if iterations else 1000)
    defaults: list[tuple[str, ...]] = []
    if unset("eval_interval"):
        defaults.append(("--eval-interval", quarter))
    if unset("eval_iters"):
        defaults.append(("--eval-iters", str(EVAL_ITERS)))
    if unset("log_interval") and iterations:
        defaults.append(("--log-interval", str(max(1, min(100, iterations // 10)))))
    if unset("save_interval") and given.save:
        defaults.append(("--save-interval", quarter))
    return defaults

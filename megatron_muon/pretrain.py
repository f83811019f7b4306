"""``python -m megatron_muon.pretrain``: GPT pretraining in Megatron-LM's own loop, Muon or Adam.

One training loop in the project, Megatron's: this entry point is ``megatron.training.pretrain``
after ``megatron_muon.integrations.megatron_lm.install()``, with Megatron's flag names for model,
run shape, data and checkpoints, and three things of its own:

- **Embedded real text by default**: byte-level tokens (vocabulary 256) of the Python standard
  library's sources, with a held-out validation split (``megatron_muon.data``); ``--text-path``
  takes a user's text file instead, and Megatron's ``--mock-data`` / ``--data-path`` (indexed
  datasets, with ``--tokenizer-type``) work as in Megatron-LM.
- **A progress line** per ``--log-interval``: iteration, learning rate, train loss, the last
  validation loss, tokens/s, step time and the optimizer step's share of it (Megatron's own log
  lines are printed as well), and a progress bar on rank 0 when stderr is a terminal.
- **A JSON log** (``--log-json PATH``: one record per logged iteration and per evaluation) and,
  with ``--plot PATH``, a PNG of the train and validation loss curves.

Model and run-length flags are enough: Megatron-FSDP with ``fsdp_dtensor`` checkpoints, position
embeddings, evaluation and logging intervals and, without a GPU, the CPU/gloo flags are filled in
where the user left them unset (``megatron_muon.pretrain_defaults``; printed once as "defaults
applied: ..."). Launch with ``torchrun``::

    torchrun --nproc-per-node 2 -m megatron_muon.pretrain --optimizer muon \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --micro-batch-size 4 --global-batch-size 8 --train-iters 40 --lr 0.02 --log-json run.json

A resume (``--load``) whose learning-rate schedule differs from the checkpoint's (another
``--train-iters``, ...) stops with an error that names Megatron's ``--override-opt_param-scheduler``
and ``--use-checkpoint-opt_param-scheduler``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_muon.integrations import checkpoint_guard, megatron_lm
from megatron_muon.pretrain_defaults import add_opt_out_flags, default_flags

__all__ = ["main", "add_pretrain_args", "RunLog"]


def add_pretrain_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This entry point's own flags (Megatron's and megatron-muon's come from ``install()``)."""
    group = parser.add_argument_group(title="megatron-muon pretrain")
    group.add_argument(
        "--config",
        type=str,
        default=None,
        help="YAML whose keys (in any top-level section) are Megatron flag names with "
        "underscores; they are applied before the command line's flags, which win.",
    )
    group.add_argument(
        "--text-path",
        type=str,
        default=None,
        help="A text file to train on as byte tokens (default: the Python standard library's "
        "sources). Ignored with --mock-data or --data-path (Megatron indexed datasets).",
    )
    group.add_argument("--log-json", type=str, default=None, help="Write the run's log here.")
    group.add_argument(
        "--plot", type=str, default=None, help="Write a PNG of the loss curves here (rank 0)."
    )
    return add_opt_out_flags(parser)


# --------------------------------------------------------------------------------------------------
# --config
# --------------------------------------------------------------------------------------------------

# Keys of the project's configs that describe a run but are no Megatron flag.
_DESCRIPTIVE_KEYS = frozenset({"name", "default_ep", "default_tp", "default_pp"})
# TransformerConfig names that Megatron's parser spells differently.
_FLAG_ALIASES = {"gated_linear_unit": "swiglu"}


def _parser() -> argparse.ArgumentParser:
    """Megatron's parser with megatron-muon's and this entry point's flags (as the run parses)."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_muon.arguments import add_muon_args

    parser = argparse.ArgumentParser(allow_abbrev=False)
    return add_pretrain_args(add_muon_args(add_megatron_arguments(parser)))


def config_flags(path: str | Path) -> list[str]:
    """Megatron flags from a YAML config: ``{section: {flag_name: value}}`` or flat.

    ``true`` gives a bare flag, ``false`` its ``--no-`` form where Megatron (or this entry point)
    has one (``use_megatron_fsdp: false`` -> ``--no-use-megatron-fsdp``), else nothing; ``null``
    leaves it out; lists become Megatron's bracketed strings (``moe_layer_freq: [0, 1]`` ->
    ``--moe-layer-freq [0,1]``).

    Raises:
        ValueError: the file is not a mapping, or a key is no flag of Megatron's, ours or this
            entry point's.
    """
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(
            f"--config {path}: expected a mapping of flag names (or of sections of them), got a "
            f"{type(data).__name__}"
        )
    items: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            items.update(value)
        else:
            items[key] = value
    options = _parser()._option_string_actions
    flags: list[str] = []
    unknown = []
    for key, value in items.items():
        option = "--" + _FLAG_ALIASES.get(key, key).replace("_", "-")
        if key in _DESCRIPTIVE_KEYS:
            continue
        if option not in options:
            unknown.append(key)
            continue
        if value is True:
            flags.append(option)
        elif value is False:
            negative = "--no-" + option[2:]
            flags += [negative] if negative in options else []
        elif value is None:
            continue
        elif isinstance(value, list):
            flags += [option, "[" + ",".join(str(v) for v in value) + "]"]
        else:
            flags += [option, str(value)]
    if unknown:
        raise ValueError(f"{path}: {sorted(unknown)} are not Megatron flags")
    return flags


def _config_path(flags: Sequence[str]) -> str | None:
    for index, flag in enumerate(flags):
        if flag == "--config" and index + 1 < len(flags):
            return flags[index + 1]
        if flag.startswith("--config="):
            return flag.split("=", 1)[1]
    return None


# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------


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

    from megatron_muon.data import ByteTextDataset, load_text_splits

    args = get_args()
    if _uses_byte_data(args):
        splits = load_text_splits(args.text_path)
        print_rank_0(
            f"> byte-level data: {splits.source}: {splits.train.numel():,} training and "
            f"{splits.valid.numel():,} validation tokens"
        )
        train = ByteTextDataset(splits.train, args.seq_length, max(1, num_samples[0]))
        valid = ByteTextDataset(splits.valid, args.seq_length, max(1, num_samples[1]))
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


def _get_batch(data_iterator: Any) -> tuple[torch.Tensor | None, ...]:
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


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple:
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
    tokens, labels, loss_mask, attention_mask, position_ids = _get_batch(data_iterator)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(_loss_func, loss_mask)


# --------------------------------------------------------------------------------------------------
# progress line, JSON log, plot
# --------------------------------------------------------------------------------------------------


@dataclass
class RunLog:
    """What the run logged: one record per logged iteration, one per evaluation."""

    train: list[dict[str, float]] = field(default_factory=list)
    valid: list[dict[str, float]] = field(default_factory=list)
    step_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    steps_since_log: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"train": self.train, "valid": self.valid}


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[..., Any], add: Callable[[float], None]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        _synchronize()
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        _synchronize()
        add(time.perf_counter() - start)
        return result

    return timed


def _scalar(value: Any) -> float:
    if torch.is_tensor(value):
        value = value.detach().float().cpu()
        return float(value[0] / value[1]) if value.numel() == 2 else float(value.mean())
    return float(value)


def _progress_bar(iteration: int, total: int, width: int = 30) -> None:
    """A one-line progress bar on rank 0's stderr, only when it is a terminal."""
    if not sys.stderr.isatty() or (
        torch.distributed.is_initialized() and torch.distributed.get_rank() != 0
    ):
        return
    done = min(width, width * iteration // max(1, total))
    end = "\n" if iteration >= total else ""
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {iteration}/{total}{end}")
    sys.stderr.flush()


def _instrument(training: Any, log: RunLog) -> None:
    """Times steps and optimizer steps; records each logged iteration and evaluation.

    Wraps, in ``megatron.training.training`` only: ``setup_model_and_optimizer`` (to time the
    optimizer's ``step``), ``train_step``, ``training_log`` and ``evaluate``.
    """
    from megatron.training import get_args, print_rank_0

    def add_step(seconds: float) -> None:
        log.step_seconds += seconds
        log.steps_since_log += 1

    def add_optimizer(seconds: float) -> None:
        log.optimizer_seconds += seconds

    setup = training.setup_model_and_optimizer

    def setup_and_time_optimizer(*args: Any, **kwargs: Any) -> Any:
        model, optimizer, scheduler = setup(*args, **kwargs)
        if optimizer is not None:
            optimizer.step = _timed(optimizer.step, add_optimizer)
        return model, optimizer, scheduler

    training.setup_model_and_optimizer = setup_and_time_optimizer
    training.train_step = _timed(training.train_step, add_step)

    training_log = training.training_log

    def log_progress(
        loss_dict: dict,
        total_loss_dict: dict,
        learning_rate: Any,
        iteration: int,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        result = training_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)
        run_args = get_args()
        _progress_bar(iteration, run_args.train_iters)
        if iteration % run_args.log_interval == 0 and "lm loss" in loss_dict:
            steps = max(1, log.steps_since_log)
            step_s = log.step_seconds / steps
            tokens = run_args.global_batch_size * run_args.seq_length
            record = {
                "iteration": iteration,
                "lr": float(learning_rate or 0.0),
                "train_loss": _scalar(loss_dict["lm loss"]),
                "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
                "step_ms": 1000.0 * step_s,
                "optimizer_share": log.optimizer_seconds / log.step_seconds
                if log.step_seconds > 0
                else 0.0,
            }
            log.train.append(record)
            last_valid = f"{log.valid[-1]['valid_loss']:.4f}" if log.valid else "-"
            print_rank_0(
                f"[megatron-muon] iter {iteration}/{run_args.train_iters} | "
                f"lr {record['lr']:.3e} | train loss {record['train_loss']:.4f} | "
                f"val loss {last_valid} | {record['tokens_per_s']:,.0f} tokens/s | "
                f"step {record['step_ms']:.1f} ms "
                f"(optimizer {100 * record['optimizer_share']:.0f}%)"
            )
            log.step_seconds = log.optimizer_seconds = 0.0
            log.steps_since_log = 0
        return result

    training.training_log = log_progress

    evaluate = training.evaluate

    def evaluate_and_record(*args: Any, **kwargs: Any) -> Any:
        result = evaluate(*args, **kwargs)
        total_loss_dict = result[0] if isinstance(result, tuple) else None
        if total_loss_dict and "lm loss" in total_loss_dict:
            # train() sets curr_iteration before it counts the step it is in.
            iteration = int(getattr(get_args(), "curr_iteration", -1)) + 1
            record = {"iteration": iteration, "valid_loss": _scalar(total_loss_dict["lm loss"])}
            # pretrain() evaluates once more after train(), on the same iteration: "final".
            if log.valid and log.valid[-1]["iteration"] == iteration:
                record["final"] = True
            log.valid.append(record)
        return result

    training.evaluate = evaluate_and_record


def _write_outputs(args: argparse.Namespace, log: RunLog) -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    if args.log_json:
        Path(args.log_json).write_text(json.dumps(log.as_dict(), indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(7, 4))
        axis.plot(
            [r["iteration"] for r in log.train],
            [r["train_loss"] for r in log.train],
            label=f"train ({args.optimizer})",
        )
        periodic = [r for r in log.valid if not r.get("final")]
        if periodic:
            axis.plot(
                [r["iteration"] for r in periodic],
                [r["valid_loss"] for r in periodic],
                "o-",
                label=f"validation ({args.optimizer})",
            )
        axis.set_xlabel("iteration")
        axis.set_ylabel("loss")
        axis.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=120)


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    """Parses Megatron's flags (plus ours), trains with ``megatron.training.pretrain``."""
    megatron_lm.install()
    checkpoint_guard.install()  # Adam state on every rank; a mismatched --load refused
    user_flags = list(sys.argv[1:] if argv is None else argv)
    try:
        config_path = _config_path(user_flags)
        from_config = config_flags(config_path) if config_path else []
        defaults = default_flags(
            _parser(), [*from_config, *user_flags], has_gpu=torch.cuda.is_available()
        )
    except ValueError as error:
        raise SystemExit(f"megatron_muon.pretrain: error: {error}") from None
    applied = [token for option in defaults for token in option]
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[megatron-muon] defaults applied: {' '.join(applied) or '(none)'}", flush=True)
    sys.argv = [sys.argv[0], *applied, *from_config, *user_flags]

    from megatron.core.enums import ModelType
    from megatron.training import pretrain, training
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(
        extra_args_provider=add_pretrain_args, args_defaults={"tokenizer_type": "NullTokenizer"}
    )
    if args.pipeline_model_parallel_size > 1 or args.context_parallel_size > 1:
        raise ValueError(
            "megatron_muon.pretrain supports tensor and data parallelism (PP = CP = 1)"
        )
    log = RunLog()
    _instrument(training, log)
    datasets_provider.is_distributed = True  # type: ignore[attr-defined]
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    try:
        pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step)
    except AssertionError as error:
        if str(error).startswith("OptimizerParamScheduler:"):
            raise SystemExit(scheduler_mismatch_message(error)) from error
        raise
    _write_outputs(args, log)


def scheduler_mismatch_message(error: AssertionError) -> str:
    """What to do when ``--load`` meets a checkpoint saved with another learning-rate schedule.

    Megatron's ``OptimizerParamScheduler.load_state_dict`` asserts that the schedule built from
    this run's flags equals the checkpoint's, unless one of its two flags says which one wins.
    """
    return (
        "megatron_muon.pretrain: error: the checkpoint's learning-rate schedule differs from the "
        f"one this run's flags give ({error}). To resume with another --train-iters (or --lr, "
        "--min-lr, --lr-warmup-iters, --lr-decay-iters, --lr-decay-style), pass "
        "--override-opt_param-scheduler (this run's values win) or "
        "--use-checkpoint-opt_param-scheduler (the checkpoint's win), as in Megatron-LM."
    )


if __name__ == "__main__":
    main()

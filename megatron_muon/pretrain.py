"""``python -m megatron_muon.pretrain``: GPT pretraining in Megatron-LM's own loop, Muon or Adam.

One training loop in the project, Megatron's: this entry point is ``megatron.training.pretrain``
after ``megatron_muon.integrations.megatron_lm.install()``, with Megatron's flag names for model,
run shape, data and checkpoints, and three things of its own:

- **Embedded real text by default**: byte-level tokens (vocabulary 256) of the Python standard
  library's sources, with a held-out validation split (``megatron_muon.cli.data``); ``--text-path``
  takes a user's text file instead, and Megatron's ``--mock-data`` / ``--data-path`` (indexed
  datasets, with ``--tokenizer-type``) work as in Megatron-LM.
- **A progress line** per ``--log-interval``: iteration, learning rate, train loss, the last
  validation loss, tokens/s, step time and the optimizer step's share of it (Megatron's own log
  lines are printed as well), and a progress bar on rank 0 when stderr is a terminal.
- **A JSON log** (``--log-json PATH``: one record per iteration and per evaluation) and, with
  ``--plot PATH``, a PNG of the train and validation loss curves (``megatron_muon.cli.loss_plot``).

Model and run-length flags are enough: Megatron-FSDP with ``fsdp_dtensor`` checkpoints, position
embeddings, evaluation and logging intervals and, without a GPU, the CPU/gloo flags are filled in
where the user left them unset (``megatron_muon.cli.pretrain_defaults``; printed once as "defaults
applied: ..."). Launch with ``torchrun``::

    torchrun --nproc-per-node 2 -m megatron_muon.pretrain --optimizer muon \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --micro-batch-size 4 --global-batch-size 8 --train-iters 40 --lr 0.02 --log-json run.json

Its parts: ``pretrain_args`` (its flags, ``--config``), ``pretrain_defaults``, ``pretrain_data``
(datasets, batches, loss) and ``integrations.megatron_lm_progress`` (progress line, run log).

A resume (``--load``) whose learning-rate schedule differs from the checkpoint's (another
``--train-iters``, ...) stops with an error that names Megatron's ``--override-opt_param-scheduler``
and ``--use-checkpoint-opt_param-scheduler``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_muon.cli.pretrain_args import add_pretrain_args, config_flags, config_path, parser
from megatron_muon.cli.pretrain_data import datasets_provider, forward_step
from megatron_muon.cli.pretrain_defaults import default_flags, has_transformer_engine
from megatron_muon.integrations import megatron_lm, megatron_lm_progress
from megatron_muon.integrations.megatron_lm_progress import RunLog

__all__ = ["main", "add_pretrain_args", "config_flags", "RunLog", "scheduler_mismatch_message"]


# --------------------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------------------


def _write_outputs(args: argparse.Namespace, log: RunLog) -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    if args.log_json:
        Path(args.log_json).write_text(json.dumps(log.as_dict(), indent=1))
    if args.plot:
        from megatron_muon.cli.loss_plot import plot_loss_curves

        plot_loss_curves({args.optimizer: log.as_dict()}, args.plot, title="megatron_muon.pretrain")


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    """Parses Megatron's flags (plus ours), trains with ``megatron.training.pretrain``."""
    megatron_lm.install()  # also Adam's state on every rank (checkpoint_guards.adam_state)
    user_flags = list(sys.argv[1:] if argv is None else argv)
    try:
        config_file = config_path(user_flags)
        from_config = config_flags(config_file) if config_file else []
        defaults = default_flags(
            parser(),
            [*from_config, *user_flags],
            has_gpu=torch.cuda.is_available(),
            has_te=has_transformer_engine(),
        )
    except ValueError as error:
        raise SystemExit(f"megatron_muon.pretrain: error: {error}") from None
    applied = [token for option in defaults for token in option]
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[megatron-muon] defaults applied: {' '.join(applied) or '(none)'}", flush=True)
    sys.argv = [sys.argv[0], *applied, *from_config, *user_flags]

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(
        extra_args_provider=add_pretrain_args, args_defaults={"tokenizer_type": "NullTokenizer"}
    )
    _notice_slow_bf16(args)
    if args.pipeline_model_parallel_size > 1 or args.context_parallel_size > 1:
        raise ValueError(
            "megatron_muon.pretrain supports tensor and data parallelism (PP = CP = 1)"
        )
    log = RunLog()
    megatron_lm_progress.install(log)  # the progress line and the run log
    # Megatron's pretrain() reads this flag off the provider function (as pretrain_gpt.py sets it);
    # mypy does not model attributes set on a function.
    datasets_provider.is_distributed = True  # type: ignore[attr-defined]  # see above
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    try:
        pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step)
    except AssertionError as error:
        if str(error).startswith("OptimizerParamScheduler:"):
            raise SystemExit(scheduler_mismatch_message(error)) from error
        raise
    _write_outputs(args, log)


def _notice_slow_bf16(args: argparse.Namespace) -> None:
    """Once, on rank 0 of a CPU run: Muon's NS in bf16 on a CPU without bf16 instructions
    (``megatron_muon.newton_schulz.matmul_rates``), and the flag that runs it in fp32."""
    if torch.cuda.is_available() or int(os.environ.get("RANK", "0")) != 0:
        return
    if args.optimizer != "muon" or getattr(args, "muon_fp32_matmul_prec", None) != "medium":
        return
    from megatron_muon.newton_schulz.matmul_rates import (
        bf16_is_slow,
        measure_matmul_rates,
        slow_bf16_message,
    )

    rates = measure_matmul_rates()
    if bf16_is_slow(rates):
        print(f"[megatron-muon] {slow_bf16_message(rates)}", flush=True)


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

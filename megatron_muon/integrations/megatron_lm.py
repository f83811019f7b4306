"""``--optimizer muon`` (or another of ``FsdpOptimizerT``) ``--use-megatron-fsdp`` in Megatron-LM's
own training loop: ``install()``.

Megatron-LM's ``pretrain_gpt.py`` trains through ``megatron.training.pretrain``, which ships inside
the megatron-core wheel. Put ``install()`` at the top of that script (before it parses arguments)
and ``--optimizer muon`` (or ``adaptive_muon``, ``lion``, ``soap``: ``FsdpOptimizerT`` of
``common.options``) works
together with ``--use-megatron-fsdp --ckpt-format fsdp_dtensor``, for every
``--data-parallel-sharding-strategy`` and HSDP (``--num-distributed-optimizer-instances``; not
soap, whose owner state needs a 1-D data-parallel mesh).

What ``install()`` patches, and why (each function wrapped, none copied; 1 and 2 are in
``megatron_lm_arguments``, 3 here, 4 in ``checkpoint_guards.vocab``, 9 in
``checkpoint_guards.integrity``, 10 in ``restart_store``; plus the packaging fix 5 and the
megatron-core fixes 6, 7, 8, 11 and 12):

1. ``megatron.training.arguments.parse_args``: our flags
(``megatron_muon.fsdp.arguments.add_muon_args``:
   ``--muon-fsdp-mode`` and the rest) are chained after the caller's ``extra_args_provider``, so
   a script that passes its own provider, or none, gets them without a second edit.
2. ``megatron.training.arguments.validate_args``: megatron-core 0.19.2 refuses Muon with
   Megatron-FSDP twice (``assert args.optimizer in ('sgd', 'adam')`` in the Megatron-FSDP block;
   ``assert not args.use_megatron_fsdp`` in the emerging-optimizer block, which also allows only the
   torch/torch_dist checkpoint formats while Megatron-FSDP requires fsdp_dtensor). Exactly when
   ``args.optimizer`` is one of ``FsdpOptimizerT`` (muon, adaptive_muon, lion, soap, ...) and
   ``args.use_megatron_fsdp``, the original runs with the optimizer reported as "adam" and the
   name is restored before the arguments are printed and returned (``--fp16`` is refused there,
   as the factory does). In 0.19.2 ``validate_args`` reads ``args.optimizer`` only at those two
   places, so every other check runs unchanged; skipping the emerging-optimizer block also keeps
   ``use_layer_wise_distributed_optimizer`` off (that optimizer shards whole params over DP, which
   Megatron-FSDP already does by rows).
   ``--qk-clip`` is taken over there too: megatron-muon's ``QKClip`` clips the main weights'
   row shards with Megatron's ``--qk-clip-threshold``, Megatron's own ``clip_qk`` (on the
   compute weights, TE only) does not run (``_take_over_qk_clip``).
   HSDP (``--num-distributed-optimizer-instances`` > 1) turns ``--overlap-grad-reduce`` on, with
   a warning (``_reduce_grads_across_hsdp_replicas``): without it megatron-core 0.19.2's
   Megatron-FSDP never reduces gradients across the HSDP replicas.
3. ``get_megatron_optimizer`` as ``megatron.training.training`` imported it (the name
   ``setup_model_and_optimizer`` calls; ``megatron.core.optimizer.get_megatron_optimizer`` itself is
   left alone): exactly when ``config.optimizer`` is one megatron-muon builds
   (``fsdp.optimizer_registry.routed_by_install``: ``FsdpOptimizerT``, and SGD, which
   megatron-core 0.19.2's ``DistributedOptimizer`` refuses) and a model
   chunk is wrapped by Megatron-FSDP, it returns megatron-muon's optimizer
   (``megatron_muon.build_muon_optimizer``: exact Muon on FSDP shards behind a step wrapper that
   installs the weights and re-syncs params; inside this loop gradients were already reduced by
   ``finalize_model_grads``, so the wrapper is told ``grads_already_synced=True``;
   ``--muon-fsdp-mode`` etc. arrive as ``MuonFsdpConfig``, ``--qk-clip`` as ``QKClipConfig``).
   Its state goes into Megatron's ``fsdp_dtensor`` checkpoints by parameter name
   (``ckpt_format="fsdp_dtensor"``: ``checkpointed_optimizer.MegatronCheckpointedOptimizer``).
   Stock megatron-core 0.19.2 would build a ``TensorParallelMuon`` that trains nothing under
   no_shard (nothing copies the main weights into the compute weights) and crashes at the first
   step under every sharded strategy (Newton-Schulz and the QKV split on uneven row shards;
   ranks whose shard is empty skip a collective the others enter). A custom loop calls
   ``build_muon_optimizer`` itself, saying whether it calls ``finish_grad_sync``.
   ``--optimizer adam`` or ``sgd`` with Megatron-FSDP (megatron-core's own optimizer) gets every
   param's state on every rank at build time (``checkpoint_guards.adam_state``): stock, its
   lazily created state hangs the first ``fsdp_dtensor`` save.
4. ``load_checkpoint`` as ``megatron.training.training`` imported it: an ``fsdp_dtensor``
   checkpoint whose vocabulary padding differs from this run's (padding follows the
   tensor-parallel size) is refused before anything loads, with an error naming both sizes and
   the ``--make-vocab-size-divisible-by`` that avoids it (``checkpoint_guards.vocab``; stock
   megatron-core stops inside the load with a bare size mismatch). Any optimizer: it raises only
   where Megatron's load would fail. Then (``checkpoint_guards.optimizer_kind``) a checkpoint whose
   optimizer state is another ``--optimizer``'s (a Muon run's ``momentum_buffer`` loaded into a
   SOAP run, ...) is refused naming both, where Megatron's partial load would wait in collectives
   for state the checkpoint does not hold. Both run after 9's file check, so a damaged
   ``.metadata`` is named there first.
5. ``megatron.core.datasets.utils.compile_helpers`` -> no-op when the wheel's built dataset helpers
   (``megatron.core.datasets.helpers_cpp``) import: the wheel ships them but not the Makefile that
   ``compile_helpers`` runs, so ``pretrain`` stops with "Failed to compile the C++ dataset helper
   functions" on any machine, GPU or not (a packaging matter; from a source checkout of Megatron-LM,
   where the extension is not built, the original runs).
6. The local core attention takes Multi-Latent Attention's ``k_channels`` / ``v_channels``
   (``local_core_attention``: a megatron-core 0.19 bug that stops MLA with
   ``--transformer-impl local`` from building, GPU or not).
7. megatron-core's multi-latent attention at TP > 1 with the local spec drops part of the shared
   rotary key's gradient (``mla_tensor_parallel`` says how); ``install()`` sums it over TP.
8. megatron-core's ``--optimizer lion`` (emerging-optimizer path) steps with Adam's betas and
   ignores ``--lion-beta1/2``; ``stock_lion.patch()`` makes it read them, as megatron-muon's Lion
   on Megatron-FSDP does (``stock_lion`` says where).
9. ``save_checkpoint`` and ``load_checkpoint`` as ``megatron.training.training`` imported them,
   for Muon with Megatron-FSDP and ``fsdp_dtensor`` (``checkpoint_guards.integrity``): a save that
   fails (a full disk) stops every rank with one error naming the directory and the cause and
   removes the half-written directory; a finished save records each file's SHA-256; ``--load``
   refuses a damaged tracker or a truncated or altered file on every rank, naming it, before
   anything loads. ``--async-save`` is refused in ``validate_args`` (2.). Then, any optimizer
   and any format (``checkpoint_guards.pickles``, ``checkpoint_guards.readers``): at every door
   a checkpoint comes in through (``load_checkpoint`` as both modules name it: ``--load``,
   ``--pretrained-checkpoint``, the RL reference load; ``load_args_from_checkpoint``:
   ``--use-checkpoint-args``), the reader Megatron will pick is found from the directory's files
   and every pickle it would read is read by a restricted unpickler on every rank; one naming a
   global outside ``checkpointing.safe_unpickle``'s allowlist, or a format not read restricted,
   is refused naming the file and the global or reason before any of it runs (stock: a crafted
   ``.metadata`` ran its code at ``--load``); ``--ckpt-trust-pickles`` opts out.
10. ``megatron.training.initialize._initialize_distributed``: under ``torchrun --max-restarts``,
   each attempt's process group on a store prefix of its own (``restart_store``: without it the
   restarted ranks read the dead attempt's gloo addresses or NCCL ids from torchrun's store and
   stop in process-group setup). Any optimizer.
11. ``--optimizer adaptive_muon``: with Megatron-FSDP, items 1-3 treat it as Muon (the factory
    builds ``ShardedAdaptiveMuon``; ``--adaptive-muon-moment2-method``,
    ``--adaptive-muon-beta2`` and ``--adaptive-muon-eps`` are added, which Megatron's parser
    lacks); without it, megatron-core's ``TensorParallelAdaptiveMuon``, which crashes at its
    first step and would scale twice, is replaced in megatron-core's registry by a fixed subclass
    (``adaptive_muon_fix``).
12. megatron-core's ``DistributedOptimizer`` over torch's Adam without Apex or Transformer Engine
    (a Megatron-DDP run, e.g. one brought over with ``python -m megatron_muon.convert``) could not
    resume a ``torch_dist`` checkpoint, and once loaded advanced one shared ``step`` per param:
    ``distributed_optimizer_resume`` makes a resume bitwise the uninterrupted run.
13. megatron-core's own distributed Muon (``--optimizer muon --use-distributed-optimizer``
    without Megatron-FSDP: ``LayerWiseDistributedOptimizer``) stopped at the first backward in
    fp32 (its children are raw torch optimizers, wrapped only under ``--bf16``):
    ``layer_wise_fp32`` wraps them in megatron-core's ``FP32Optimizer``, so such a run trains and
    saves ``torch_dist`` (the run ``python -m megatron_muon.convert`` brings over).

Every other combination (adam with Megatron-FSDP but for its state made at build time, muon without
Megatron-FSDP, ...) reaches the original functions with the original arguments. Checked against
megatron-core 0.19.0 and 0.19.2 (0.19.1 was never published): between them only the version strings,
the inference text server, ``model_chunk_schedule_plan``, ``multi_token_prediction`` and
``transformer_layer`` changed; every function patched here, and every module the factory, the step
wrapper and the checkpointing import (``megatron.training``, ``megatron.core.optimizer``,
``distributed``, the vendored ``megatron_fsdp``, ``fsdp_dtensor_checkpoint``) is byte-identical.
``install()`` accepts ``SUPPORTED_MEGATRON_CORE`` (pyproject.toml declares the same range) and
raises on any other version rather than patch code it has not read.
On a machine without a GPU, ``install()`` also applies ``megatron_muon.cpu_stand_ins.
install_for_training()`` (gloo/CPU runs); with a GPU nothing of that module is touched.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from megatron_muon.common.megatron_fsdp_compat import uses_megatron_fsdp
from megatron_muon.fsdp.arguments import (
    fsdp_config_from_args,
    qk_clip_config_from_args,
    settings_onto_config,
)
from megatron_muon.fsdp.checkpointed_optimizer import (
    MegatronCheckpointedOptimizer,
    megatron_args,
)
from megatron_muon.fsdp.optimizer_registry import routed_by_install
from megatron_muon.integrations import (
    adaptive_muon_fix,
    distributed_optimizer_resume,
    layer_wise_fp32,
    local_core_attention,
    mla_tensor_parallel,
    restart_store,
    stock_lion,
)
from megatron_muon.integrations.checkpoint_guards import integrity as checkpoint_integrity
from megatron_muon.integrations.checkpoint_guards.adam_state import with_rank_symmetric_state
from megatron_muon.integrations.checkpoint_guards.optimizer_kind import (
    checking_optimizer_state_first,
)
from megatron_muon.integrations.checkpoint_guards.pickles import (
    install_other_doors,
    refusing_unsafe_pickles,
)
from megatron_muon.integrations.checkpoint_guards.vocab import checking_vocab_padding_first
from megatron_muon.integrations.megatron_lm_arguments import (
    accepting_muon_with_fsdp,
    extra_args_provider,
    muon_meets_megatron_fsdp,
    with_muon_args,
)
from megatron_muon.integrations.megatron_version import (
    SUPPORTED_MEGATRON_CORE,
    check_megatron_core_version,
)

__all__ = [
    "SUPPORTED_MEGATRON_CORE",
    "check_megatron_core_version",
    "install",
    "installed",
    "use_shipped_dataset_helpers",
    "extra_args_provider",
    "muon_meets_megatron_fsdp",
    "uses_megatron_fsdp",
    "MegatronCheckpointedOptimizer",
]

_INSTALLED = False
# Marks our get_megatron_optimizer: a caller (or test) can tell it from Megatron's own.
ROUTED_MARK = "_megatron_muon_routed"


def installed() -> bool:
    """True once ``install()`` has run in this process."""
    return _INSTALLED


def install(*, cpu_stand_ins: bool | None = None) -> None:
    """Makes ``megatron.training`` accept and run ``--optimizer muon|lion --use-megatron-fsdp``.

    Idempotent; call it before Megatron parses arguments (first line of the launcher script).

    Args:
        cpu_stand_ins: apply ``megatron_muon.cpu_stand_ins.install_for_training()``; default: when
            no GPU is present.

    Raises:
        RuntimeError: the installed megatron-core is not a version this patch was checked against.
    """
    global _INSTALLED
    check_megatron_core_version()
    if cpu_stand_ins is None:
        cpu_stand_ins = not torch.cuda.is_available()
    if cpu_stand_ins:
        from megatron_muon import cpu_stand_ins as stand_ins

        stand_ins.install_for_training()
    if _INSTALLED:
        return
    arguments: Any = importlib.import_module("megatron.training.arguments")
    training: Any = importlib.import_module("megatron.training.training")

    arguments.parse_args = with_muon_args(arguments.parse_args)
    arguments.validate_args = accepting_muon_with_fsdp(arguments.validate_args, arguments)
    training.get_megatron_optimizer = _routing_muon_with_fsdp(training.get_megatron_optimizer)
    training.get_megatron_optimizer = with_rank_symmetric_state(training.get_megatron_optimizer)
    training.load_checkpoint = checking_vocab_padding_first(training.load_checkpoint)
    training.load_checkpoint = checking_optimizer_state_first(training.load_checkpoint)
    training.load_checkpoint = refusing_unsafe_pickles(training.load_checkpoint)
    training.load_checkpoint = checkpoint_integrity.verifying_files_first(training.load_checkpoint)
    install_other_doors()  # checkpointing's load_checkpoint, load_args_from_checkpoint
    training.save_checkpoint = checkpoint_integrity.saving_whole_or_refused(
        training.save_checkpoint
    )
    use_shipped_dataset_helpers()
    local_core_attention.patch()
    mla_tensor_parallel.install()
    restart_store.patch()
    stock_lion.patch()
    adaptive_muon_fix.install()
    distributed_optimizer_resume.patch()
    layer_wise_fp32.patch()
    _INSTALLED = True


def use_shipped_dataset_helpers() -> None:
    """5. ``compile_helpers`` does nothing when the built helpers import (module docstring)."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return
    utils: Any = importlib.import_module("megatron.core.datasets.utils")
    utils.compile_helpers = _helpers_already_built


def _helpers_already_built() -> None:
    """``compile_helpers`` with the wheel's built ``helpers_cpp`` present: nothing to build."""


# --------------------------------------------------------------------------------------------------
# 3. get_megatron_optimizer (1 and 2: megatron_lm_arguments)
# --------------------------------------------------------------------------------------------------


def _routing_muon_with_fsdp(get_megatron_optimizer: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(get_megatron_optimizer)

    @functools.wraps(get_megatron_optimizer)
    def get_optimizer_routing_muon(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        config = bound.arguments["config"]
        model_chunks = bound.arguments["model_chunks"]
        name = getattr(config, "optimizer", None)
        if not routed_by_install(str(name)) or not uses_megatron_fsdp(model_chunks):
            return get_megatron_optimizer(*args, **kwargs)
        return _build_for_megatron_loop(
            config,
            model_chunks,
            config_overrides=bound.arguments.get("config_overrides"),
            pg_collection=bound.arguments.get("pg_collection"),
        )

    setattr(get_optimizer_routing_muon, ROUTED_MARK, True)
    return get_optimizer_routing_muon


def _build_for_megatron_loop(
    config: Any, model_chunks: Any, *, config_overrides: Any, pg_collection: Any
) -> Any:
    """megatron-muon's optimizer for chunks that Megatron's ``train_step`` drives.

    Megatron's ``train_step`` runs ``finalize_model_grads`` (which calls ``finish_grad_sync`` on
    every chunk) before ``optimizer.step()``; a second call would reduce gradients twice and
    corrupt the ``optim`` strategy, hence ``grads_already_synced``. Megatron's flags arrive as
    ``fsdp_config_from_args`` (``--muon-fsdp-mode`` ...), ``qk_clip_config_from_args``
    (``--qk-clip`` ...) and ``--check-for-nan-in-loss-and-grad`` (Megatron's default; off with its
    ``--no-`` form).
    """
    from megatron_muon.fsdp.factory import build_muon_optimizer

    args = megatron_args()
    if args is not None:  # --laprop-eps, --psgd-pro-*, ...: flags OptimizerConfig has no field for
        settings_onto_config(args, config)
    return build_muon_optimizer(
        config,
        model_chunks,
        config_overrides=config_overrides,
        pg_collection=pg_collection,
        fsdp_config=fsdp_config_from_args(args) if args is not None else None,
        qk_clip=qk_clip_config_from_args(args) if args is not None else None,
        grads_already_synced=True,
        ckpt_format="fsdp_dtensor",
        stop_on_nonfinite_grad_norm=(
            getattr(args, "check_for_nan_in_loss_and_grad", True) if args is not None else True
        ),
    )

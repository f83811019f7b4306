"""CPU stand-ins for the CUDA-only calls megatron-core and megatron_fsdp make.
May import ``common`` only.

This is the one place where the project substitutes anything in the libraries it stands on. It is
used by the multi-rank tests and by the CPU (gloo) path of the pretrain entry point, and it is
applied **only when no GPU is present** (``install()`` raises on a machine with CUDA). Nothing here
changes numerics: each stand-in replaces a device query, a CUDA stream or a hard-coded
``device="cuda"`` with its CPU equivalent. Every item was shown necessary on CPU/gloo (megatron-core
0.19.2, megatron-fsdp 0.6.1) by turning it off and watching the failure. Call ``install()`` in each
rank after ``init_process_group("gloo")`` (a forkserver preload must not: patches are per
process); ``install_for_training()`` before Megatron-LM's ``pretrain`` (which creates the process
group itself).

``torch.cuda`` runtime (``cuda_runtime``) and Megatron-FSDP (``fsdp``; both copies: the
``megatron_fsdp`` package and megatron-core's vendored
``megatron.core.distributed.fsdp.src.megatron_fsdp``):

- ``torch.cuda.current_device`` -> 0: ``megatron_fsdp.py`` builds ``torch.device("cuda:N")``
  from it; the device finally used is the ``device=`` argument (cpu).
- ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` -> no-op objects: grad reduce and param
  all-gather run on side streams; on CPU every op is already ordered.
- ``Tensor.cuda()`` -> identity inside ``uneven_dtensor.validate_uneven_dtensor`` (a boundary check
  tensor is moved to cuda before an all-reduce).
- the mcore adapter's ``DeviceMesh.from_group(..., device_type="cuda")`` -> ``"cpu"``.
- ``_coalescing_manager`` in ``param_and_grad_buffer`` runs synchronously: an async parameter
  all-gather into a bucket that CPU memory management recycles early corrupts the heap.
- ``gradient_reduce_preprocessing`` never picks ``PREMUL_SUM`` (NCCL-only; "Cannot use
  ReduceOp.PREMUL_SUM with Gloo"): it takes the scale-then-SUM branch that
  ``gradient_reduce_div_fusion=False`` selects. Where a config is built by hand, set that field
  instead; ``fully_shard_model`` exposes no such argument, hence the stand-in.

megatron-core's optimizer wrappers, grad clipping, utils, schedules and MoE layers
(``device_redirect``):

- tensor factories (``torch.tensor/zeros/ones/empty/full/*_like/arange``) called with a CUDA device
  (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")`` or an int) allocate on CPU instead; applied to
  the module-level name ``torch`` only inside the modules ``cpu_device_redirect_modules()`` lists.
- while ``clip_grad_by_total_norm_fp32`` runs, ``Tensor.type()`` reports CPU fp32 as
  ``torch.cuda.FloatTensor`` (an assert in clip_grads.py); likewise, CPU fp32/bf16/fp16 as their
  CUDA types, while megatron-core's ``DistributedOptimizer`` groups its params and
  ``Float16OptimizerWithFloat16Params`` is built (both accept CUDA types only: Megatron's DDP path,
  e.g. ``LayerWiseDistributedOptimizer``, a bench peer).
- Megatron-DDP's param and grad buffers (``param_and_grad_buffer``) and
  ``LayerWiseDistributedOptimizer`` allocate on ``current_device()`` / ``"cuda"``: CPU.
- ``torch.cuda.current_device()`` -> ``torch.device("cpu")`` inside the MoE router and
  ``tensor_parallel.mappings`` (``_CURRENT_DEVICE_CPU_MODULES``): ``TopKRouter.gating`` moves a
  CPU router weight to ``current_device()`` before every forward (router.py:98), i.e. to
  ``cuda:0``; with expert parallelism the token gathers allocate with
  ``device=current_device()`` (mappings.py:145, both dispatchers) and the all-to-all's output
  with ``input.new_empty(..., device=current_device())`` (:444); with expert tensor parallelism
  the token dispatcher's all-gather / reduce-scatter over the expert TP group likewise
  (mappings.py:95, 185).
- the all-to-all dispatcher's split sizes become NumPy arrays (``maybe_move_tensor_to_cpu`` in
  ``token_dispatcher``): it moves them to the host only when ``is_cuda``, and gloo's
  ``all_to_all_single`` rejects tensor split sizes.

Tensor parallelism (TP > 1; ``cuda_runtime``):

- ``torch.cuda.get_rng_state`` / ``set_rng_state`` -> the CPU generator's state (``torch.
  get_rng_state`` / ``set_rng_state``): megatron-core's ``FullyShardedDataParallel`` broadcasts TP
  rank 0's RNG states, CUDA's included, over the TP group when it wraps a model
  (``sync_rng_states_across_tp_group``), and Megatron-LM's checkpoints save and restore the "CUDA"
  RNG state next to the CPU one; on CPU both are the one generator's, read at the same moment, so
  a resumed run restores a real state.

Sequence parallelism (``sequence_parallel_norm``):

- ``WrappedTorchNorm`` (the local spec's norm without Apex) with ``config.sequence_parallel``:
  the same torch norm, its params marked ``sequence_parallel`` so that the loop sums their
  gradients over TP (what Apex's and Transformer Engine's norms do); stock it asserts, which stops
  every MoE model at TP > 1 (megatron-core requires sequence parallelism there).

- the uneven all-gather / reduce-scatter of expert tensor parallelism's token dispatch
  (``uneven_collectives``): gloo refuses lists of unequal tensors; the same results through a
  padded all-gather and an all-reduce, only where split sizes are given.
- ``LayerWiseDistributedOptimizer.allgather_params`` (megatron-core's own distributed Muon, as
  Megatron-LM's config-container builder sets it up: no precomputed layout) all-gathers one flat
  tensor per rank of each rank's own length (``uneven_collectives``): gloo refuses it; while it
  runs, such an all-gather pads to the longest and cuts each rank's length back (bit for bit).

megatron-core's ``torch_dist`` checkpoints of a Megatron-DDP run (``device_redirect``): the save's
finalize broadcasts its failure flag from a tensor on ``torch.cuda.current_device()``
(``state_dict_saver.py:251``): there it names the CPU (``_CURRENT_DEVICE_CPU_MODULES``). (Its
resume without Apex or Transformer Engine is megatron-core's bug on any machine, not a CUDA call:
``integrations.distributed_optimizer_resume``, applied by ``megatron_lm.install()``.)

Megatron-LM's own training loop, ``megatron.training.pretrain`` (``install_for_training()``, on top
of everything above; ``training_loop``):

- ``torch.cuda.synchronize`` -> no-op: the loop's timers synchronize before reading the clock.
- ``Tensor.cuda()`` -> the tensor itself: Megatron-LM's ``pretrain_gpt.py`` moves each batch with
  ``.cuda(non_blocking=True)`` in its own ``get_batch`` (the user's script: no module-level
  redirect reaches it), as does ``training.dummy_train_step``.
- ``megatron.training.arguments.get_device_arch_version`` -> 0: ``validate_args`` asks the GPU's
  compute capability for Megatron-FSDP's stream priorities.
- ``initialize_megatron(allow_no_cuda=True)``: it asserts a GPU is present unless told otherwise.
- ``torch.cuda.device_count`` -> 1 and ``set_device`` -> no-op, during ``_initialize_distributed``
  only: model-parallel groups are created only when a GPU is counted.
- a CPU RNG tracker (``training_loop._cpu_rng_tracker_class``) after ``_set_random_seed``: the
  training tracker snapshots CUDA RNG states; on CPU the default generator is the only one, so
  ``fork`` is a null context (random ops inside it draw from the CPU generator, which checkpoints
  save). It keeps, per name, a CPU generator state seeded as the CUDA one would be, so that
  checkpoints carry a non-empty tracker state: Megatron's load refuses an empty one ("Unable to
  load rng state") and exits without training, which made CPU resumes need ``--no-load-rng``.
- Megatron's data loaders (``build_pretraining_data_loader``) get a generator of their own
  (seeded 0) for the one number a ``DataLoader`` draws when an iterator is created (its workers'
  base seed). On a GPU that draw comes from the CPU generator, which dropout (on the CUDA
  generator) never sees; on CPU dropout draws from that generator too, and a resumed run, which
  builds its iterators after the checkpoint's RNG state is restored, would draw different masks.
- ``FullyShardedDataParallel(device=None)`` -> ``device=cpu``: the wrapper otherwise places its
  buffers on ``cuda:current_device()``.
- the device redirect above, extended to the loop's modules
  (``device_redirect.TRAINING_REDIRECT_MODULES``).

Megatron-Bridge's training loop, ``megatron.bridge.training.pretrain`` (``install_for_bridge()``,
on top of ``install_for_training()``; ``bridge_loop``, whose docstring lists them): Bridge's own
``initialize_megatron`` without ``allow_no_cuda``, its RNG seeding, and four Bridge modules' CUDA
allocations.
"""

from __future__ import annotations

import torch

from megatron_muon.cpu_stand_ins import (
    bridge_loop,
    cuda_runtime,
    device_redirect,
    fsdp,
    sequence_parallel_norm,
    training_loop,
    uneven_collectives,
)
from megatron_muon.cpu_stand_ins.device_redirect import cpu_device_redirect_modules

__all__ = [
    "install",
    "install_for_bridge",
    "install_for_training",
    "installed",
    "cpu_device_redirect_modules",
]

_INSTALLED = False
_TRAINING_INSTALLED = False
_BRIDGE_INSTALLED = False


def installed() -> bool:
    """True once ``install()`` has run in this process."""
    return _INSTALLED


def install(extra_redirect_modules: list[str] | None = None) -> None:
    """Applies every CPU stand-in to this process. Idempotent.

    Call it in each rank after ``init_process_group("gloo")`` (a forkserver preload must not call
    it: patches are per process).

    Args:
        extra_redirect_modules: more modules whose ``torch`` is redirected (added for good).

    Raises:
        RuntimeError: if a CUDA device is present; the stand-ins are for machines without one.
    """
    global _INSTALLED
    if torch.cuda.is_available():
        raise RuntimeError(
            "megatron_muon.cpu_stand_ins.install() is for machines without a GPU; "
            "a CUDA device is present, so run on it instead."
        )
    if extra_redirect_modules:
        device_redirect.add_redirect_modules(extra_redirect_modules)
    if _INSTALLED:
        device_redirect.redirect_module_devices()
        return
    cuda_runtime.patch()
    fsdp.patch()
    device_redirect.patch()
    sequence_parallel_norm.patch()
    uneven_collectives.patch()
    _INSTALLED = True


def install_for_training() -> None:
    """Applies ``install()`` plus the stand-ins ``megatron.training.pretrain`` needs. Idempotent.

    Unlike ``install()`` this may run before ``init_process_group``: Megatron's loop creates the
    process group itself, inside ``initialize_megatron``, and every stand-in here is a function
    replacement that takes effect when the loop calls it.

    Raises:
        RuntimeError: if a CUDA device is present.
    """
    global _TRAINING_INSTALLED
    install(extra_redirect_modules=device_redirect.TRAINING_REDIRECT_MODULES)
    if _TRAINING_INSTALLED:
        return
    training_loop.patch()
    _TRAINING_INSTALLED = True


def install_for_bridge() -> None:
    """Applies ``install_for_training()`` plus the stand-ins Megatron-Bridge's ``pretrain`` needs
    (``bridge_loop``). Idempotent; may run before ``init_process_group``, as Bridge creates it.

    Raises:
        RuntimeError: if a CUDA device is present.
    """
    global _BRIDGE_INSTALLED
    install_for_training()
    if _BRIDGE_INSTALLED:
        return
    bridge_loop.patch()
    _BRIDGE_INSTALLED = True

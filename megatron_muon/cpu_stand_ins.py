"""CPU stand-ins for the CUDA-only calls megatron-core and megatron_fsdp make.

This is the one place where the project substitutes anything in the libraries it stands on. It is
used by the multi-rank tests and by the CPU (gloo) path of the pretrain entry point, and it is
applied **only when no GPU is present** (``install()`` raises on a machine with CUDA). Nothing here
changes numerics: each stand-in replaces a device query, a CUDA stream or a hard-coded
``device="cuda"`` with its CPU equivalent. Every item was shown necessary on CPU/gloo by turning it
off and watching the failure (../shared/REFERENCE.md sections 2, 6 and 8).

Megatron-FSDP (both copies: the ``megatron_fsdp`` package and megatron-core's vendored
``megatron.core.distributed.fsdp.src.megatron_fsdp``), REFERENCE.md section 2:

- ``torch.cuda.current_device`` -> 0: ``megatron_fsdp.py`` builds ``torch.device("cuda:N")``
  from it;
  the device that is finally used is the ``device=`` argument (cpu).
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

megatron-core's optimizer wrappers, grad clipping, utils and schedules (section 6):

- tensor factories (``torch.tensor/zeros/ones/empty/full/*_like/arange``) called with a CUDA device
  (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")`` or an int) allocate on CPU instead; applied to
  the module-level name ``torch`` only inside the modules listed in ``_DEVICE_REDIRECT_MODULES``.
- while ``clip_grad_by_total_norm_fp32`` runs, ``Tensor.type()`` reports CPU fp32 as
  ``torch.cuda.FloatTensor`` (an assert in clip_grads.py).
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

Tensor parallelism (TP > 1):

- ``torch.cuda.get_rng_state`` / ``set_rng_state`` -> the CPU generator's state (``torch.
  get_rng_state`` / ``set_rng_state``): megatron-core's ``FullyShardedDataParallel`` broadcasts TP
  rank 0's RNG states, CUDA's included, over the TP group when it wraps a model
  (``sync_rng_states_across_tp_group``), and Megatron-LM's checkpoints save and restore the "CUDA"
  RNG state next to the CPU one; on CPU both are the one generator's, read at the same moment, so
  a resumed run restores a real state.

Megatron-LM's own training loop, ``megatron.training.pretrain`` (``install_for_training()``, on top
of everything above; section 8):

- ``torch.cuda.synchronize`` -> no-op: the loop's timers synchronize before reading the clock.
- ``Tensor.cuda()`` -> the tensor itself: Megatron-LM's ``pretrain_gpt.py`` moves each batch with
  ``.cuda(non_blocking=True)`` in its own ``get_batch`` (the user's script: no module-level
  redirect reaches it), as does ``training.dummy_train_step``.
- ``megatron.training.arguments.get_device_arch_version`` -> 0: ``validate_args`` asks the GPU's
  compute capability for Megatron-FSDP's stream priorities.
- ``initialize_megatron(allow_no_cuda=True)``: it asserts a GPU is present unless told otherwise.
- ``torch.cuda.device_count`` -> 1 and ``set_device`` -> no-op, during ``_initialize_distributed``
  only: model-parallel groups are created only when a GPU is counted.
- a CPU RNG tracker (``_cpu_rng_tracker_class``) after ``_set_random_seed``: the training tracker
  snapshots CUDA RNG states; on CPU the default generator is the only one, so ``fork`` is a null
  context (random ops inside it draw from the CPU generator, which checkpoints save). It keeps,
  per name, a CPU generator state seeded as the CUDA one would be, so that checkpoints carry a
  non-empty tracker state: Megatron's load refuses an empty one ("Unable to load rng state") and
  exits without training, which made CPU resumes need ``--no-load-rng``.
- Megatron's data loaders (``build_pretraining_data_loader``) get a generator of their own
  (seeded 0) for the one number a ``DataLoader`` draws when an iterator is created (its workers'
  base seed). On a GPU that draw comes from the CPU generator, which dropout (on the CUDA
  generator) never sees; on CPU dropout draws from that generator too, and a resumed run, which
  builds its iterators after the checkpoint's RNG state is restored, would draw different masks.
- ``megatron.core.datasets.utils.compile_helpers`` -> no-op: the wheel ships the built dataset
  helpers but not their Makefile (packaging, not CUDA).
- ``FullyShardedDataParallel(device=None)`` -> ``device=cpu``: the wrapper otherwise places its
  buffers on ``cuda:current_device()``.
- the device redirect above, extended to the loop's modules (``_TRAINING_REDIRECT_MODULES``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from typing import Any

import torch

__all__ = ["install", "install_for_training", "installed", "cpu_device_redirect_modules"]

_INSTALLED = False

# Modules whose module-level ``torch`` name is replaced by a proxy that redirects CUDA allocations.
_DEVICE_REDIRECT_MODULES = [
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.distrib_optimizer",
]

# Megatron-LM's training loop modules that allocate on "cuda" (install_for_training()).
_TRAINING_REDIRECT_MODULES = [
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.checkpointing",
    "megatron.training.utils.common_utils",
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
    # get_default_causal_mask: the local attention's mask when the data loader sends none.
    "megatron.core.transformer.utils",
]

# Modules that move tensors to ``torch.cuda.current_device()``: there it names the CPU.
_CURRENT_DEVICE_CPU_MODULES = [
    "megatron.core.transformer.moe.router",
    # Expert parallelism's all-to-all: torch.empty(..., device=current_device()) in the gathers,
    # input.new_empty(..., device=current_device()) for the uneven all-to-all's output.
    "megatron.core.tensor_parallel.mappings",
]

_FACTORIES = (
    "tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand",
    "randn",
    "as_tensor",
)

_FSDP_PACKAGES = ("megatron_fsdp", "megatron.core.distributed.fsdp.src.megatron_fsdp")


def installed() -> bool:
    """True once ``install()`` has run in this process."""
    return _INSTALLED


def cpu_device_redirect_modules() -> list[str]:
    """Names of the modules whose ``torch`` is redirected (extend before ``install()``)."""
    return _DEVICE_REDIRECT_MODULES


def install(extra_redirect_modules: list[str] | None = None) -> None:
    """Applies every CPU stand-in to this process. Idempotent.

    Call it in each rank after ``init_process_group("gloo")`` (a forkserver preload must not call
    it:
    patches are per process).

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
        for name in extra_redirect_modules:
            if name not in _DEVICE_REDIRECT_MODULES:
                _DEVICE_REDIRECT_MODULES.append(name)
    if _INSTALLED:
        _redirect_module_devices()
        return
    _patch_cuda_runtime()
    for package in _FSDP_PACKAGES:
        _patch_uneven_dtensor(package)
        _patch_gradient_reduce_preprocessing(package)
        _patch_coalesced_param_gather(package)
    _patch_mcore_fsdp_adapter()
    _patch_moe_split_sizes_to_host()
    _redirect_module_devices()
    _patch_clip_grads_type_check()
    _INSTALLED = True


# --------------------------------------------------------------------------------------------------
# torch.cuda runtime
# --------------------------------------------------------------------------------------------------


class _NoOpEvent:
    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoOpStream:
    """Stands in for ``torch.cuda.Stream``: CPU ops are already ordered."""

    device = torch.device("cpu")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _NoOpEvent:
        return _NoOpEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _NoOpStream()



def _patch_cuda_runtime() -> None:
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.Stream = _NoOpStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _DEFAULT_STREAM  # type: ignore[assignment]
    torch.cuda.default_stream = lambda *a, **k: _DEFAULT_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    # Record-stream bookkeeping on CPU tensors has nothing to record.
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign]
    # There is no CUDA generator: the CPU generator stands in (TP RNG sync, checkpoints).
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore


# --------------------------------------------------------------------------------------------------
# megatron_fsdp
# --------------------------------------------------------------------------------------------------


def _patch_uneven_dtensor(package: str) -> None:
    """``validate_uneven_dtensor`` moves a boundary-check tensor to cuda: keep it on CPU."""
    try:
        module = importlib.import_module(f"{package}.uneven_dtensor")
    except ImportError:
        return
    original = module.validate_uneven_dtensor
    if getattr(original, "_cpu_stand_in", False):
        return

    @functools.wraps(original)
    def validate_on_cpu(*args: Any, **kwargs: Any) -> Any:
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
        try:
            return original(*args, **kwargs)
        finally:
            torch.Tensor.cuda = saved  # type: ignore[method-assign]

    validate_on_cpu._cpu_stand_in = True  # type: ignore[attr-defined]
    module.validate_uneven_dtensor = validate_on_cpu
    # Modules that imported the function by name.
    for name in ("megatron_fsdp", "utils", "fully_shard", "param_and_grad_buffer"):
        try:
            other = importlib.import_module(f"{package}.{name}")
        except ImportError:
            continue
        if getattr(other, "validate_uneven_dtensor", None) is original:
            other.validate_uneven_dtensor = validate_on_cpu


class _NoDivFusion:
    """A DDP config view with ``gradient_reduce_div_fusion`` off (PREMUL_SUM is NCCL-only)."""

    def __init__(self, config: Any) -> None:
        self._config = config

    gradient_reduce_div_fusion = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _patch_gradient_reduce_preprocessing(package: str) -> None:
    try:
        module = importlib.import_module(f"{package}.param_and_grad_buffer")
    except ImportError:
        return
    original = module.gradient_reduce_preprocessing
    if getattr(original, "_cpu_stand_in", False):
        return

    @functools.wraps(original)
    def without_premul_sum(grad_data: Any, scaling_factor: Any, ddp_config: Any) -> Any:
        return original(grad_data, scaling_factor, _NoDivFusion(ddp_config))

    without_premul_sum._cpu_stand_in = True  # type: ignore[attr-defined]
    module.gradient_reduce_preprocessing = without_premul_sum


def _patch_coalesced_param_gather(package: str) -> None:
    """Parameter all-gathers complete before their coalescing block exits (no async gloo ops).

    megatron_fsdp launches the parameter all-gather of the next FSDP unit asynchronously
    (``_coalescing_manager(group, async_ops=True)``) and relies on CUDA stream ordering and the
    caching allocator (``record_stream``) to keep the target bucket alive until the gather is
    done. On CPU neither exists: a bucket recycled while gloo's worker thread still writes into it
    corrupts the heap ("malloc(): unaligned tcache chunk detected", seen once in ~10 runs of a
    2-rank pretrain test). Synchronous coalescing removes the overlap, not any data.
    """
    try:
        module = importlib.import_module(f"{package}.param_and_grad_buffer")
    except ImportError:
        return
    original = module._coalescing_manager
    if getattr(original, "_cpu_stand_in", False):
        return

    def synchronous_coalescing(group: Any = None, device: Any = None, async_ops: bool = False):
        return original(group, device, async_ops=False)

    synchronous_coalescing._cpu_stand_in = True  # type: ignore[attr-defined]
    module._coalescing_manager = synchronous_coalescing


class _CpuDeviceMesh:
    """Forwards to ``DeviceMesh`` but builds meshes from groups on CPU."""

    def __init__(self, device_mesh_cls: type) -> None:
        self._cls = device_mesh_cls

    def from_group(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["device_type"] = "cpu"
        return self._cls.from_group(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and args[0] == "cuda":
            args = ("cpu",) + args[1:]
        if kwargs.get("device_type") == "cuda":
            kwargs["device_type"] = "cpu"
        return self._cls(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cls, name)

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self._cls)


def _patch_mcore_fsdp_adapter() -> None:
    try:
        adapter = importlib.import_module("megatron.core.distributed.fsdp.mcore_fsdp_adapter")
    except ImportError:
        return
    if not isinstance(adapter.DeviceMesh, _CpuDeviceMesh):
        adapter.DeviceMesh = _CpuDeviceMesh(adapter.DeviceMesh)


# --------------------------------------------------------------------------------------------------
# device redirect for megatron-core modules that allocate on "cuda"
# --------------------------------------------------------------------------------------------------


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _redirecting(factory: Any) -> Any:
    @functools.wraps(factory)
    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return on_cpu


class _CpuTorchProxy(types.ModuleType):
    """Looks like ``torch`` to a module, with CUDA tensor factories redirected to CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _redirecting(getattr(torch, name)))
        self.cuda = _CudaProxy()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _CudaProxy(types.ModuleType):
    """``torch.cuda`` whose ``FloatTensor`` etc. are CPU types and memory queries return zero."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        pass


_TORCH_PROXY = _CpuTorchProxy()


class _CpuCurrentDeviceCudaProxy(_CudaProxy):
    """``torch.cuda`` whose ``current_device()`` is the CPU device (a move target)."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")


class _CpuCurrentDeviceTorchProxy(_CpuTorchProxy):
    """``_CpuTorchProxy`` whose ``torch.cuda.current_device()`` is the CPU device."""

    def __init__(self) -> None:
        super().__init__()
        self.cuda = _CpuCurrentDeviceCudaProxy()


_TORCH_PROXY_CPU_CURRENT_DEVICE = _CpuCurrentDeviceTorchProxy()


def _redirect_module_devices() -> None:
    for name in _DEVICE_REDIRECT_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = _TORCH_PROXY
    for name in _CURRENT_DEVICE_CPU_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = _TORCH_PROXY_CPU_CURRENT_DEVICE


def _patch_moe_split_sizes_to_host() -> None:
    """The all-to-all dispatcher's split sizes become host (NumPy) values, as on a GPU.

    ``MoEAlltoAllTokenDispatcher`` computes its all-to-all split sizes on the device and moves them
    to the host with ``moe_utils.maybe_move_tensor_to_cpu(t, as_numpy=True)``, which does nothing
    to a tensor that is not ``is_cuda``: on CPU the sizes stay tensors, and gloo's
    ``all_to_all_single`` rejects tensor split sizes ("incompatible function arguments").
    """
    try:
        dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    except ImportError:
        return
    original = dispatcher.maybe_move_tensor_to_cpu
    if getattr(original, "_cpu_stand_in", False):
        return

    @functools.wraps(original)
    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().clone().numpy()  # a host copy, as the GPU path makes
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    to_host._cpu_stand_in = True  # type: ignore[attr-defined]
    dispatcher.maybe_move_tensor_to_cpu = to_host


# --------------------------------------------------------------------------------------------------
# clip_grads' type assert
# --------------------------------------------------------------------------------------------------


def _patch_clip_grads_type_check() -> None:
    """``clip_grad_by_total_norm_fp32`` asserts grads are ``torch.cuda.FloatTensor``."""
    try:
        clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
        optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    except ImportError:
        return
    original = clip_grads.clip_grad_by_total_norm_fp32
    if getattr(original, "_cpu_stand_in", False):
        return
    real_type = torch.Tensor.type

    def type_as_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = real_type(self, *args, **kwargs)
        if not args and not kwargs and result == "torch.FloatTensor":
            return "torch.cuda.FloatTensor"
        return result

    @functools.wraps(original)
    def clip_on_cpu(*args: Any, **kwargs: Any) -> Any:
        torch.Tensor.type = type_as_cuda  # type: ignore[method-assign]
        try:
            return original(*args, **kwargs)
        finally:
            torch.Tensor.type = real_type  # type: ignore[method-assign]

    clip_on_cpu._cpu_stand_in = True  # type: ignore[attr-defined]
    clip_grads.clip_grad_by_total_norm_fp32 = clip_on_cpu
    if getattr(optimizer, "clip_grad_by_total_norm_fp32", None) is original:
        optimizer.clip_grad_by_total_norm_fp32 = clip_on_cpu


# --------------------------------------------------------------------------------------------------
# Megatron-LM's training loop (megatron.training.pretrain)
# --------------------------------------------------------------------------------------------------

_TRAINING_INSTALLED = False


def install_for_training() -> None:
    """Applies ``install()`` plus the stand-ins ``megatron.training.pretrain`` needs. Idempotent.

    Unlike ``install()`` this may run before ``init_process_group``: Megatron's loop creates the
    process group itself, inside ``initialize_megatron``, and every stand-in here is a function
    replacement that takes effect when the loop calls it.

    Raises:
        RuntimeError: if a CUDA device is present.
    """
    global _TRAINING_INSTALLED
    install(extra_redirect_modules=_TRAINING_REDIRECT_MODULES)
    if _TRAINING_INSTALLED:
        return
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.Tensor.cuda = _cuda_stays_on_cpu  # type: ignore[method-assign]
    _patch_training_arguments()
    _patch_training_initialize()
    _patch_dataset_helpers()
    _patch_data_loader_generator()
    _patch_fsdp_default_device()
    _TRAINING_INSTALLED = True


def _cuda_stays_on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.cuda()`` on a machine without a GPU: the tensor itself, on CPU.

    Megatron-LM's ``pretrain_gpt.py`` moves every batch with ``batch[key].cuda(non_blocking=True)``
    in its ``get_batch`` (so does ``megatron.training.training.dummy_train_step``); that code is
    the user's script, out of reach of a module-level redirect, and without a GPU the call can only
    fail ("Found no NVIDIA driver").
    """
    return self


@functools.cache
def _cpu_rng_tracker_class() -> type:
    """Megatron's RNG tracker for a machine whose only generator is the CPU's (module docstring).

    Built on first use: ``megatron.core`` is imported only when the stand-ins are installed.
    """
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRngTracker(CudaRNGStatesTracker):
        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_ or name in self.states_:
                raise RuntimeError(f"RNG state {name} (seed {seed}) already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        def fork(self, name: str = "") -> contextlib.AbstractContextManager:
            return contextlib.nullcontext()

    return CpuRngTracker


def _install_cpu_rng_tracker(seed: int) -> None:
    """Megatron's tracker states for ``seed`` (data, tensor, expert parallel), in a CPU tracker."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    # model_parallel_cuda_manual_seed keeps an initialized tracker (no force_reset) and adds its
    # named seeds to it; its torch.cuda.manual_seed is a lazy no-op without CUDA.
    random._CUDA_RNG_STATE_TRACKER = _cpu_rng_tracker_class()()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    random.model_parallel_cuda_manual_seed(seed)


def _patch_training_arguments() -> None:
    """``validate_args`` reads the GPU's compute capability (arguments.py, Megatron-FSDP block)."""
    arguments = importlib.import_module("megatron.training.arguments")
    arguments.get_device_arch_version = lambda: 0


def _patch_training_initialize() -> None:
    """``initialize_megatron``: allow no CUDA; count one device while creating groups; CPU RNG."""
    initialize = importlib.import_module("megatron.training.initialize")
    training = importlib.import_module("megatron.training.training")

    original_initialize = initialize.initialize_megatron
    if not getattr(original_initialize, "_cpu_stand_in", False):

        @functools.wraps(original_initialize)
        def initialize_without_cuda(*args: Any, **kwargs: Any) -> Any:
            kwargs["allow_no_cuda"] = True
            return original_initialize(*args, **kwargs)

        initialize_without_cuda._cpu_stand_in = True  # type: ignore[attr-defined]
        initialize.initialize_megatron = initialize_without_cuda
        if getattr(training, "initialize_megatron", None) is original_initialize:
            training.initialize_megatron = initialize_without_cuda

    original_distributed = initialize._initialize_distributed
    if not getattr(original_distributed, "_cpu_stand_in", False):

        @functools.wraps(original_distributed)
        def distributed_with_one_device(*args: Any, **kwargs: Any) -> Any:
            # mpu.initialize_model_parallel runs only when torch.cuda.device_count() > 0.
            saved = torch.cuda.device_count, torch.cuda.set_device
            torch.cuda.device_count = lambda: 1  # type: ignore[assignment]
            torch.cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]
            try:
                return original_distributed(*args, **kwargs)
            finally:
                torch.cuda.device_count, torch.cuda.set_device = saved  # type: ignore[assignment]

        distributed_with_one_device._cpu_stand_in = True  # type: ignore[attr-defined]
        initialize._initialize_distributed = distributed_with_one_device

    original_seed = initialize._set_random_seed
    if not getattr(original_seed, "_cpu_stand_in", False):

        @functools.wraps(original_seed)
        def seed_with_cpu_tracker(seed: int, *args: Any, **kwargs: Any) -> Any:
            # The CPU seeds are set by the original; with no GPU counted it skips the CUDA
            # tracker, which model code forks and checkpoints save: the CPU tracker instead.
            result = original_seed(seed, *args, **kwargs)
            _install_cpu_rng_tracker(seed)
            return result

        seed_with_cpu_tracker._cpu_stand_in = True  # type: ignore[attr-defined]
        initialize._set_random_seed = seed_with_cpu_tracker


def _patch_dataset_helpers() -> None:
    """The wheel ships the compiled dataset helpers but not the Makefile that builds them."""
    utils = importlib.import_module("megatron.core.datasets.utils")
    utils.compile_helpers = lambda: None


def _patch_data_loader_generator() -> None:
    """Megatron's data loaders draw their workers' base seed from a generator of their own."""
    samplers = importlib.import_module("megatron.training.datasets.data_samplers")
    training = importlib.import_module("megatron.training.training")
    original = samplers.build_pretraining_data_loader
    if getattr(original, "_cpu_stand_in", False):
        return

    @functools.wraps(original)
    def loader_with_own_generator(*args: Any, **kwargs: Any) -> Any:
        loader = original(*args, **kwargs)
        if loader is not None:
            loader.generator = torch.Generator().manual_seed(0)
        return loader

    loader_with_own_generator._cpu_stand_in = True  # type: ignore[attr-defined]
    samplers.build_pretraining_data_loader = loader_with_own_generator
    if getattr(training, "build_pretraining_data_loader", None) is original:
        training.build_pretraining_data_loader = loader_with_own_generator


def _patch_fsdp_default_device() -> None:
    """megatron-core's ``FullyShardedDataParallel`` defaults to ``cuda:current_device()``."""
    distributed = importlib.import_module("megatron.core.distributed")
    wrapper = distributed.FullyShardedDataParallel
    original = wrapper.__init__
    if getattr(original, "_cpu_stand_in", False):
        return

    @functools.wraps(original)
    def init_on_cpu(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("device") is None and len(args) < 6:  # device is the 6th argument
            kwargs["device"] = torch.device("cpu")
        original(self, *args, **kwargs)

    init_on_cpu._cpu_stand_in = True  # type: ignore[attr-defined]
    wrapper.__init__ = init_on_cpu

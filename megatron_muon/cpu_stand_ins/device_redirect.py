"""CPU stand-ins for megatron-core's optimizers, grad clipping, utils, schedules, DDP buffers and
MoE layers.

These modules allocate on ``device="cuda"`` or move tensors to ``torch.cuda.current_device()``
themselves: the stand-in replaces the module-level name ``torch`` inside each listed module (and
nowhere else) by a proxy whose tensor factories allocate on CPU when asked for a CUDA device
(package docstring). Functions are wrapped as well: the MoE all-to-all's split sizes,
clip_grads' type assert and the Megatron-DDP optimizers' param type checks.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from megatron_muon.cpu_stand_ins._replace import (
    MARK,
    import_optional,
    replace_once,
    set_stand_in,
)

__all__ = [
    "TRAINING_REDIRECT_MODULES",
    "add_redirect_modules",
    "cpu_device_redirect_modules",
    "patch",
    "redirect_module_devices",
]

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
TRAINING_REDIRECT_MODULES = [
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
    # Multi-Latent Attention's RoPE and YaRN embeddings: built without use_cpu_initialization, they
    # place their inverse frequencies on torch.cuda.current_device().
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    # Expert parallelism's all-to-all: torch.empty(..., device=current_device()) in the gathers,
    # input.new_empty(..., device=current_device()) for the uneven all-to-all's output.
    "megatron.core.tensor_parallel.mappings",
    # Sequence parallelism's backward: the reduce-scatter's output is torch.empty(...,
    # device=current_device()) (layers.py:647).
    "megatron.core.tensor_parallel.layers",
    # megatron-core's DistributedDataParallel (not Megatron-FSDP): its param and grad buffers are
    # allocated on current_device() (param_and_grad_buffer.py:1162-1186).
    "megatron.core.distributed.param_and_grad_buffer",
    # LayerWiseDistributedOptimizer (Megatron's own distributed Muon, a bench peer): its
    # found-inf flag is a tensor on "cuda".
    "megatron.core.optimizer.layer_wise_optimizer",
    # torch_dist checkpoints (Megatron's own format, without Megatron-FSDP): the save's finalize
    # broadcasts a failure flag allocated on current_device() (state_dict_saver.py:251).
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
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


def cpu_device_redirect_modules() -> list[str]:
    """Names of the modules whose ``torch`` is redirected (extend before ``install()``)."""
    return _DEVICE_REDIRECT_MODULES


def add_redirect_modules(names: Sequence[str]) -> None:
    """Adds module names to the redirect (applied by the next ``redirect_module_devices()``)."""
    for name in names:
        if name not in _DEVICE_REDIRECT_MODULES:
            _DEVICE_REDIRECT_MODULES.append(name)


def patch() -> None:
    """The MoE split sizes on the host, the module redirect, clip_grads' and the Megatron-DDP
    optimizers' type checks (in order)."""
    _patch_moe_split_sizes_to_host()
    redirect_module_devices()
    _patch_clip_grads_type_check()
    _patch_optimizer_type_checks()


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


def redirect_module_devices() -> None:
    """Each listed module's ``torch`` name becomes its proxy (modules not installed: skipped)."""
    for names, proxy in (
        (_DEVICE_REDIRECT_MODULES, _TORCH_PROXY),
        (_CURRENT_DEVICE_CPU_MODULES, _TORCH_PROXY_CPU_CURRENT_DEVICE),
    ):
        for name in names:
            module = import_optional(name)
            if module is not None and getattr(module, "torch", None) is torch:
                set_stand_in(module, "torch", proxy)


def _patch_moe_split_sizes_to_host() -> None:
    """The all-to-all dispatcher's split sizes become host (NumPy) values, as on a GPU.

    ``MoEAlltoAllTokenDispatcher`` computes its all-to-all split sizes on the device and moves them
    to the host with ``moe_utils.maybe_move_tensor_to_cpu(t, as_numpy=True)``, which does nothing
    to a tensor that is not ``is_cuda``: on CPU the sizes stay tensors, and gloo's
    ``all_to_all_single`` rejects tensor split sizes ("incompatible function arguments").
    """
    dispatcher = import_optional("megatron.core.transformer.moe.token_dispatcher")
    if dispatcher is None:
        return

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
            if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
                return tensor.detach().clone().numpy()  # a host copy, as the GPU path makes
            return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

        return to_host

    replace_once(dispatcher, "maybe_move_tensor_to_cpu", make)


_CPU_FLOAT_TYPES = ("torch.FloatTensor", "torch.BFloat16Tensor", "torch.HalfTensor")


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    """Within: ``Tensor.type()`` names CPU float tensors by their CUDA types (``torch.FloatTensor``
    -> ``torch.cuda.FloatTensor``, bf16 and fp16 alike), for checks that accept CUDA types only."""
    real_type = torch.Tensor.type

    def type_as_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = real_type(self, *args, **kwargs)
        if not args and not kwargs and result in _CPU_FLOAT_TYPES:
            return result.replace("torch.", "torch.cuda.")
        return result

    set_stand_in(torch.Tensor, "type", type_as_cuda)
    try:
        yield
    finally:
        set_stand_in(torch.Tensor, "type", real_type)


def _patch_clip_grads_type_check() -> None:
    """``clip_grad_by_total_norm_fp32`` asserts grads are ``torch.cuda.FloatTensor``.

    It is imported by name into ``megatron.core.optimizer.optimizer``: replaced there too.
    """
    try:
        clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
        importlib.import_module("megatron.core.optimizer.optimizer")
    except ImportError:
        return

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def clip_on_cpu(*args: Any, **kwargs: Any) -> Any:
            with _cuda_type_names():
                return original(*args, **kwargs)

        return clip_on_cpu

    replace_once(
        clip_grads,
        "clip_grad_by_total_norm_fp32",
        make,
        also_in=["megatron.core.optimizer.optimizer"],
    )


# Methods of megatron-core's Megatron-DDP optimizers that accept only ``torch.cuda.*Tensor`` params:
# the distributed optimizer's grouping (a classmethod; the AdamW part of
# ``LayerWiseDistributedOptimizer``) and the bf16 optimizer's constructor (its Muon part in bf16).
_CUDA_TYPE_CHECKS = [
    (
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer",
        "_build_model_and_main_param_groups",
    ),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__"),
]


def _patch_optimizer_type_checks() -> None:
    """Each method of ``_CUDA_TYPE_CHECKS`` runs with CPU type names reported as CUDA ones."""
    for module_name, class_name, method_name in _CUDA_TYPE_CHECKS:
        module = import_optional(module_name)
        if module is None:
            continue
        owner = getattr(module, class_name)
        attribute = owner.__dict__[method_name]
        if getattr(attribute, MARK, False) or getattr(
            getattr(attribute, "__func__", None), MARK, False
        ):
            continue
        is_classmethod = isinstance(attribute, classmethod)
        original = attribute.__func__ if is_classmethod else attribute

        def on_cpu(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with _cuda_type_names():
                return _original(*args, **kwargs)

        functools.update_wrapper(on_cpu, original)
        setattr(on_cpu, MARK, True)
        set_stand_in(owner, method_name, classmethod(on_cpu) if is_classmethod else on_cpu)

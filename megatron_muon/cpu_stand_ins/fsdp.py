"""CPU stand-ins for Megatron-FSDP, in both copies of megatron_fsdp (package docstring).

Both the ``megatron_fsdp`` package and the copy megatron-core vendors are patched: megatron-core's
``FullyShardedDataParallel`` uses its own copy, ``fully_shard_model`` the package's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_muon.common.megatron_fsdp_compat import MEGATRON_FSDP_PACKAGES
from megatron_muon.cpu_stand_ins._replace import (
    import_optional,
    replace_once,
    set_stand_in,
)

__all__ = ["patch"]


def patch() -> None:
    """Every megatron_fsdp stand-in, in each installed copy, and the mcore adapter's mesh."""
    for package in MEGATRON_FSDP_PACKAGES:
        _patch_uneven_dtensor(package)
        _patch_gradient_reduce_preprocessing(package)
        _patch_coalesced_param_gather(package)
    _patch_mcore_fsdp_adapter()


def _patch_uneven_dtensor(package: str) -> None:
    """``validate_uneven_dtensor`` moves a boundary-check tensor to cuda: keep it on CPU."""
    module = import_optional(f"{package}.uneven_dtensor")
    if module is None:
        return

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def validate_on_cpu(*args: Any, **kwargs: Any) -> Any:
            saved = torch.Tensor.cuda
            set_stand_in(torch.Tensor, "cuda", lambda self, *a, **k: self)
            try:
                return original(*args, **kwargs)
            finally:
                set_stand_in(torch.Tensor, "cuda", saved)

        return validate_on_cpu

    # Modules that imported the function by name.
    importers = ("megatron_fsdp", "utils", "fully_shard", "param_and_grad_buffer")
    replace_once(
        module, "validate_uneven_dtensor", make, also_in=[f"{package}.{n}" for n in importers]
    )


class _NoDivFusion:
    """A DDP config view with ``gradient_reduce_div_fusion`` off (PREMUL_SUM is NCCL-only)."""

    def __init__(self, config: Any) -> None:
        self._config = config

    gradient_reduce_div_fusion = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _patch_gradient_reduce_preprocessing(package: str) -> None:
    module = import_optional(f"{package}.param_and_grad_buffer")
    if module is None:
        return

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def without_premul_sum(grad_data: Any, scaling_factor: Any, ddp_config: Any) -> Any:
            return original(grad_data, scaling_factor, _NoDivFusion(ddp_config))

        return without_premul_sum

    replace_once(module, "gradient_reduce_preprocessing", make)


def _patch_coalesced_param_gather(package: str) -> None:
    """Parameter all-gathers complete before their coalescing block exits (no async gloo ops).

    megatron_fsdp launches the parameter all-gather of the next FSDP unit asynchronously
    (``_coalescing_manager(group, async_ops=True)``) and relies on CUDA stream ordering and the
    caching allocator (``record_stream``) to keep the target bucket alive until the gather is
    done. On CPU neither exists: a bucket recycled while gloo's worker thread still writes into it
    corrupts the heap ("malloc(): unaligned tcache chunk detected" in a 2-rank pretrain run;
    docs/megatron-fsdp-measurements.md). Synchronous coalescing removes the overlap, not any data.
    """
    module = import_optional(f"{package}.param_and_grad_buffer")
    if module is None:
        return

    def make(original: Any) -> Any:
        def synchronous_coalescing(group: Any = None, device: Any = None, async_ops: bool = False):
            return original(group, device, async_ops=False)

        return synchronous_coalescing

    replace_once(module, "_coalescing_manager", make)


class _CpuDeviceMesh:
    """Forwards to ``DeviceMesh`` but builds meshes from groups on CPU."""

    def __init__(self, device_mesh_cls: Any) -> None:
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
    adapter = import_optional("megatron.core.distributed.fsdp.mcore_fsdp_adapter")
    if adapter is None:
        return
    if not isinstance(adapter.DeviceMesh, _CpuDeviceMesh):
        set_stand_in(adapter, "DeviceMesh", _CpuDeviceMesh(adapter.DeviceMesh))

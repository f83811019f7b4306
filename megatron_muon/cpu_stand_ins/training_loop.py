"""CPU stand-ins for Megatron-LM's own training loop, ``megatron.training.pretrain``.

Applied by ``install_for_training()`` on top of ``install()``'s (the package docstring's last list).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any

import torch

from megatron_muon.cpu_stand_ins._replace import replace_once, set_stand_in

__all__ = ["patch"]


def patch() -> None:
    """Every training-loop stand-in (the device redirect's extra modules are ``install()``'s)."""
    set_stand_in(torch.cuda, "synchronize", lambda *a, **k: None)
    set_stand_in(torch.Tensor, "cuda", _cuda_stays_on_cpu)
    _patch_training_arguments()
    _patch_training_initialize()
    _patch_data_loader_generator()
    _patch_fsdp_default_device()


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
    """Megatron's RNG tracker for a machine whose only generator is the CPU's (package docstring).

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


def install_cpu_rng_tracker(seed: int) -> None:
    """Megatron's tracker states for ``seed`` (data, tensor, expert parallel), in a CPU tracker."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    # model_parallel_cuda_manual_seed keeps an initialized tracker (no force_reset) and adds its
    # named seeds to it; its torch.cuda.manual_seed is a lazy no-op without CUDA.
    set_stand_in(random, "_CUDA_RNG_STATE_TRACKER", _cpu_rng_tracker_class()())
    set_stand_in(random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    random.model_parallel_cuda_manual_seed(seed)


def _patch_training_arguments() -> None:
    """``validate_args`` reads the GPU's compute capability (arguments.py, Megatron-FSDP block)."""
    arguments = importlib.import_module("megatron.training.arguments")
    set_stand_in(arguments, "get_device_arch_version", lambda: 0)


def _patch_training_initialize() -> None:
    """``initialize_megatron``: allow no CUDA; count one device while creating groups; CPU RNG."""
    initialize = importlib.import_module("megatron.training.initialize")
    importlib.import_module("megatron.training.training")
    replace_once(
        initialize, "initialize_megatron", allowing_no_cuda, also_in=["megatron.training.training"]
    )

    def make_distributed(original: Any) -> Any:
        @functools.wraps(original)
        def distributed_with_one_device(*args: Any, **kwargs: Any) -> Any:
            # mpu.initialize_model_parallel runs only when torch.cuda.device_count() > 0.
            saved = torch.cuda.device_count, torch.cuda.set_device
            set_stand_in(torch.cuda, "device_count", lambda: 1)
            set_stand_in(torch.cuda, "set_device", lambda *a, **k: None)
            try:
                return original(*args, **kwargs)
            finally:
                set_stand_in(torch.cuda, "device_count", saved[0])
                set_stand_in(torch.cuda, "set_device", saved[1])

        return distributed_with_one_device

    replace_once(initialize, "_initialize_distributed", make_distributed)

    replace_once(initialize, "_set_random_seed", seeding_cpu_tracker)


def allowing_no_cuda(initialize_megatron: Any) -> Any:
    """``initialize_megatron`` called with ``allow_no_cuda=True`` (Megatron-LM's and Bridge's)."""

    @functools.wraps(initialize_megatron)
    def initialize_without_cuda(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    return initialize_without_cuda


def seeding_cpu_tracker(set_random_seed: Any) -> Any:
    """``_set_random_seed`` (Megatron-LM's and Bridge's), then the CPU RNG tracker for its seed.

    The CPU seeds are set by the original; with no GPU counted it skips the CUDA tracker, which
    model code forks and checkpoints save: the CPU tracker instead.
    """

    @functools.wraps(set_random_seed)
    def seed_with_cpu_tracker(seed: int, *args: Any, **kwargs: Any) -> Any:
        result = set_random_seed(seed, *args, **kwargs)
        install_cpu_rng_tracker(seed)
        return result

    return seed_with_cpu_tracker


def _patch_data_loader_generator() -> None:
    """Megatron's data loaders draw their workers' base seed from a generator of their own."""
    samplers = importlib.import_module("megatron.training.datasets.data_samplers")
    importlib.import_module("megatron.training.training")

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def loader_with_own_generator(*args: Any, **kwargs: Any) -> Any:
            loader = original(*args, **kwargs)
            if loader is not None:
                loader.generator = torch.Generator().manual_seed(0)
            return loader

        return loader_with_own_generator

    replace_once(
        samplers, "build_pretraining_data_loader", make, also_in=["megatron.training.training"]
    )


def _patch_fsdp_default_device() -> None:
    """megatron-core's ``FullyShardedDataParallel`` defaults to ``cuda:current_device()``."""
    distributed = importlib.import_module("megatron.core.distributed")

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def init_on_cpu(self: Any, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("device") is None and len(args) < 6:  # device is the 6th argument
                kwargs["device"] = torch.device("cpu")
            original(self, *args, **kwargs)

        return init_on_cpu

    replace_once(distributed.FullyShardedDataParallel, "__init__", make)

"""CPU stand-ins for Megatron-Bridge's training loop, ``megatron.bridge.training.pretrain``.

Applied by ``install_for_bridge()`` on top of ``install_for_training()``'s (Megatron-LM's loop
shares megatron-core's code below Bridge). Each item was shown necessary on CPU/gloo with
Megatron-Bridge 0.6.2 by turning it off and watching the failure:

- ``initialize_megatron(allow_no_cuda=True)`` (``setup.py`` calls it without): it asserts a GPU.
- ``_set_random_seed``: seeds the model-parallel RNG tracker only when a GPU is counted, and the
  model's first forward stops with "cuda rng state model-parallel-rng is not added"; the CPU
  tracker of ``training_loop`` instead, as for Megatron-LM.
- the device redirect over Bridge's modules that allocate on ``"cuda"`` or
  ``torch.cuda.current_device()`` (``BRIDGE_REDIRECT_MODULES``; without it "Found no NVIDIA
  driver"): the JIT warm-up tensors (``initialize._warmup_jit_function``), the start-time and
  train/valid/test flag tensors (``setup.setup``, ``data.loaders``), and the all-reduced check in
  ``training.utils.train_utils``. Bridge's ``train`` and ``checkpointing`` modules need none for a
  Megatron-FSDP run that saves and resumes ``fsdp_dtensor`` checkpoints.
"""

from __future__ import annotations

import importlib

from megatron_muon.cpu_stand_ins import device_redirect
from megatron_muon.cpu_stand_ins._replace import replace_once
from megatron_muon.cpu_stand_ins.training_loop import allowing_no_cuda, seeding_cpu_tracker

__all__ = ["BRIDGE_REDIRECT_MODULES", "patch"]

# Bridge's modules that allocate on "cuda" or torch.cuda.current_device() (module docstring).
BRIDGE_REDIRECT_MODULES = [
    "megatron.bridge.training.initialize",
    "megatron.bridge.training.setup",
    "megatron.bridge.data.loaders",
    "megatron.bridge.training.utils.train_utils",
]


def patch() -> None:
    """Every Bridge-loop stand-in."""
    device_redirect.add_redirect_modules(BRIDGE_REDIRECT_MODULES)
    device_redirect.redirect_module_devices()
    initialize = importlib.import_module("megatron.bridge.training.initialize")
    replace_once(
        initialize,
        "initialize_megatron",
        allowing_no_cuda,
        also_in=["megatron.bridge.training.setup"],
    )
    replace_once(initialize, "_set_random_seed", seeding_cpu_tracker)

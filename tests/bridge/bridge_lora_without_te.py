"""Lets Megatron-Bridge import where Transformer Engine cannot be installed (CPU test machines).

``import megatron.bridge`` reaches ``megatron/bridge/peft/lora_layers.py`` (through its model
conversion registry), which runs ``import transformer_engine.pytorch as te`` at module level and
evaluates ``te.ops.Sequential`` in annotations; Transformer Engine does not install without CUDA.
Pretraining never builds a LoRA layer, so that one module gets a stand-in ``te`` whose every name is
a class that raises when used, **only while that module executes**: the stand-in is removed from
``sys.modules`` afterwards, so megatron-core's own ``try: import transformer_engine`` checks keep
finding no Transformer Engine. ``install()`` checks that the import window added no module beyond
Bridge's own LoRA modules (any other module could have seen the stand-in).

This is test-environment setup, not part of the package: ``scripts/setup_bridge_venv.sh`` puts a
``.pth`` line into ``.venv-bridge`` that calls ``install()`` at interpreter start-up, and only when
``transformer_engine`` is not installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

LORA_LAYERS = "megatron.bridge.peft.lora_layers"
_TE_NAMES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops")
# Modules lora_layers itself imports (its Bridge siblings); anything else new in the window fails.
_ALLOWED_NEW = {
    LORA_LAYERS,
    "megatron.bridge.peft.adapter_wrapper",
    "megatron.bridge.peft.lora_merge",
}


class TransformerEngineAbsent:
    """What every name of the stand-in ``te`` is: a class that cannot be built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "Transformer Engine is not installed: Megatron-Bridge's LoRA layers need it "
            "(tests/bridge/bridge_lora_without_te.py)"
        )


def _stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__getattr__ = lambda attr: TransformerEngineAbsent  # type: ignore[method-assign]
    return module


class _LoraLayersLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        te, pytorch, ops = (_stand_in(name) for name in _TE_NAMES)
        te.pytorch, pytorch.ops = pytorch, ops  # type: ignore[attr-defined]
        before = set(sys.modules)
        sys.modules.update(zip(_TE_NAMES, (te, pytorch, ops), strict=True))
        try:
            self._loader.exec_module(module)
        finally:
            for name in _TE_NAMES:
                sys.modules.pop(name, None)
        added = set(sys.modules) - before - set(_TE_NAMES) - _ALLOWED_NEW
        if added:
            raise ImportError(
                f"importing {LORA_LAYERS} with the Transformer Engine stand-in also imported "
                f"{sorted(added)}, which may have seen it: import them first"
            )


class _LoraLayersFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != LORA_LAYERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoraLayersLoader(spec.loader)
        return spec


def install() -> None:
    """Adds the finder when Transformer Engine is absent (idempotent)."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    if not any(isinstance(finder, _LoraLayersFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LoraLayersFinder())

"""Deprecated: the module paths of megatron-muon 0.1. ``megatron_muon.sharded`` was split into
``megatron_muon.engine`` (the owner engine) and ``megatron_muon.optimizers`` (the optimizers on
it) in 0.2.0. Importing an old path, e.g. ``megatron_muon.sharded.sharded_muon``, still works for
this release: it warns (``DeprecationWarning`` naming the new path) and gives the new module
itself, so classes and functions are the same objects. Removed in 0.3.0."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

# Old module name (under megatron_muon.sharded) -> its module in 0.2.
MOVED = {
    **{
        name: f"megatron_muon.engine.{name}"
        for name in (
            "bucket_cuts",
            "bucket_schedule",
            "config",
            "exchange",
            "gather_exchange",
            "layout",
            "momentum_offload",
            "ns_runner",
            "optimizer_plan",
            "owner_pipeline",
            "planner",
            "qkv",
            "step_plan",
            "tensor_parallel",
            "tp_grid",
        )
    },
    "soap_state": "megatron_muon.engine.owner_state",
    "sharded_muon": "megatron_muon.optimizers.muon",
    "adaptive_muon": "megatron_muon.optimizers.adaptive_muon",
    "moment2_partitions": "megatron_muon.optimizers.moment2_partitions",
    "orthogonalized": "megatron_muon.optimizers.orthogonalized",
    "orthogonalized_adapters": "megatron_muon.optimizers.orthogonalized_adapters",
    "sharded_soap": "megatron_muon.optimizers.soap",
    "soap_matrix": "megatron_muon.optimizers.soap_matrix",
    "soap_plan": "megatron_muon.optimizers.soap_plan",
}


def _moved_module(old: str) -> ModuleType:
    """The 0.2 module behind ``megatron_muon.sharded.<old>``, after a ``DeprecationWarning``."""
    new = MOVED[old]
    warnings.warn(
        f"megatron_muon.sharded.{old} is deprecated and will be removed in 0.3.0; import {new}",
        DeprecationWarning,
        stacklevel=3,
    )
    return importlib.import_module(new)


class _AliasLoader(importlib.abc.Loader):
    """Makes ``import megatron_muon.sharded.<old>`` bind the new module under the old name."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return _moved_module(spec.name.rpartition(".")[2])

    def exec_module(self, module: ModuleType) -> None:
        """The module is the new one, already executed."""


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds only ``megatron_muon.sharded.<old>`` for the old names in ``MOVED``."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, old = fullname.rpartition(".")
        if prefix != __name__ or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader())


def __getattr__(name: str) -> ModuleType:
    """``megatron_muon.sharded.<old>`` as an attribute (``from megatron_muon.sharded import x``)."""
    if name in MOVED:
        module = sys.modules.get(f"{__name__}.{name}") or _moved_module(name)
        globals()[name] = module  # warned once: ``from ... import`` looks the name up twice
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())

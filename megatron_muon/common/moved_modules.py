"""Old module paths kept importable for one release after a module moved.

``alias_moved_modules(package, moved, removed_in)`` makes ``import <package>.<old>`` (and
``from <package> import <old>``) give the new module itself, after a ``DeprecationWarning`` naming
it: classes and functions are the same objects under both names. Used by ``megatron_muon.sharded``
(0.1's paths, moved in 0.2.0) and ``megatron_muon.integrations`` (the checkpoint guards, moved into
``integrations.checkpoint_guards`` in 0.3.0).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType

__all__ = ["alias_moved_modules"]


class _AliasLoader(importlib.abc.Loader):
    """Binds the new module under the old name."""

    def __init__(self, load: Callable[[str], ModuleType]) -> None:
        self._load = load

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self._load(spec.name.rpartition(".")[2])

    def exec_module(self, module: ModuleType) -> None:
        """The module is the new one, already executed."""


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds only ``<package>.<old>`` for the old names of one package."""

    def __init__(self, package: str, moved: Mapping[str, str], load: Callable[[str], ModuleType]):
        self.package, self._moved, self._load = package, moved, load

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, old = fullname.rpartition(".")
        if prefix != self.package or old not in self._moved:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(self._load))


def alias_moved_modules(
    package: str, moved: Mapping[str, str], removed_in: str
) -> Callable[[str], ModuleType]:
    """Registers the old names ``<package>.<old>`` of ``moved`` (old name -> new module path).

    Returns the package's module ``__getattr__`` (assign it in the package's ``__init__``), which
    serves ``from <package> import <old>``.
    """

    def moved_module(old: str) -> ModuleType:
        new = moved[old]
        warnings.warn(
            f"{package}.{old} is deprecated and will be removed in {removed_in}; import {new}",
            DeprecationWarning,
            stacklevel=3,
        )
        return importlib.import_module(new)

    def package_getattr(name: str) -> ModuleType:
        if name in moved:
            module = sys.modules.get(f"{package}.{name}") or moved_module(name)
            # Warned once: ``from ... import`` looks the name up twice.
            setattr(sys.modules[package], name, module)
            return module
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    if not any(
        isinstance(finder, _AliasFinder) and finder.package == package for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _AliasFinder(package, moved, moved_module))
    return package_getattr

"""How a CPU stand-in replaces a function: once, marked, also where it was imported by name."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["import_optional", "replace_once"]

# The attribute that marks a replacement, so that a second install() leaves it alone.
MARK = "_cpu_stand_in"


def import_optional(name: str) -> ModuleType | None:
    """The module ``name``, or None where it is not installed (e.g. one copy of megatron_fsdp)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def replace_once(
    module: ModuleType,
    name: str,
    make: Callable[[Any], Any],
    also_in: Sequence[str] = (),
) -> None:
    """``module.<name> = make(original)`` unless already replaced; then the same in the modules
    named in ``also_in`` (those installed) that imported the original by name."""
    original = getattr(module, name)
    if getattr(original, MARK, False):
        return
    replacement = make(original)
    setattr(replacement, MARK, True)
    setattr(module, name, replacement)
    for other_name in also_in:
        other = import_optional(other_name)
        if other is not None and getattr(other, name, None) is original:
            setattr(other, name, replacement)

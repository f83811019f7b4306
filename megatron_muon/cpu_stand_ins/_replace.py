"""How a CPU stand-in replaces a function: once, marked, also where it was imported by name."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["import_optional", "replace_once", "set_stand_in"]

# The attribute that marks a replacement, so that a second install() leaves it alone.
MARK = "_cpu_stand_in"


def import_optional(name: str) -> ModuleType | None:
    """The module ``name``, or None where it is not installed (e.g. one copy of megatron_fsdp)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def set_stand_in(owner: object, name: str, value: object) -> None:
    """``owner.<name> = value``: a CPU stand-in put in place of a torch or Megatron attribute.

    Through ``setattr`` on purpose: a stand-in does not have the declared type of what it replaces
    (a lambda for ``torch.cuda.current_stream``, a class for ``torch.cuda.Stream``), and Megatron's
    modules are not typed here at all.
    """
    setattr(owner, name, value)


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

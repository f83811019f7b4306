"""An emerging optimizer's settings beyond megatron-core's ``OptimizerConfig`` fields, as a frozen
dataclass with a ``prefix`` (the registry name): read from ``<prefix>_<field>`` attributes
(megatron-core's rule for an emerging optimizer's keywords, ``_kwargs_from_config``), given to the
class as keywords, and turned into ``--<prefix>-<field>`` flags by
``fsdp.arguments.add_optimizer_config_flags``."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

__all__ = ["as_keywords", "read_settings"]


def read_settings(cls: Any, config: Any) -> Any:
    """``cls`` from ``config.<cls.prefix>_<field>`` (``OptimizerConfig``, where a custom trainer
    sets them, or Megatron's parsed args), each field's default where ``config`` lacks it.

    Raises:
        ValueError: a value ``cls`` refuses, naming the ``<prefix>_<field>`` read (``cls``'s
            messages start with the field's name).
    """
    prefix = cls.prefix  # a ClassVar of each settings dataclass
    values = {
        f.name: getattr(config, f"{prefix}_{f.name}")
        for f in fields(cls)
        if hasattr(config, f"{prefix}_{f.name}")
    }
    try:
        return cls(**values)
    except ValueError as error:
        raise ValueError(f"{prefix}_{error}") from None


def as_keywords(settings: Any) -> dict[str, Any]:
    """A settings dataclass's fields as the optimizer class's constructor keywords."""
    return {f.name: getattr(settings, f.name) for f in fields(settings)}

"""``ShardedMuon`` from flat keywords: ``TensorParallelMuon``'s (``momentum=``, ``nesterov=``, ...)
and ``MuonFsdpConfig``'s (``mode=``, ...), each by its name, into the two configs the constructor
takes. ``ShardedMuon.from_keywords`` reads them so (tests and benchmarks comparing with
``TensorParallelMuon``); 0.1's constructor took them directly, which 0.2 still accepts with a
``DeprecationWarning`` (removed in 0.3.0)."""

from __future__ import annotations

import inspect
import warnings
from dataclasses import fields
from typing import Any

from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

from megatron_muon.engine.config import MuonConfig, MuonFsdpConfig

__all__ = ["configs_of_keywords", "deprecated_flat_keywords"]

_MUON_FIELDS = {f.name for f in fields(MuonConfig)}
_FSDP_FIELDS = {f.name for f in fields(MuonFsdpConfig)}
# TensorParallelMuon's defaults of the MuonConfig fields (e.g. nesterov=True, tp_mode="duplicated"),
# which the fields not named take.
_TENSOR_PARALLEL_MUON_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(TensorParallelMuon.__init__).parameters.items()
    if name in _MUON_FIELDS
}


def configs_of_keywords(
    keywords: dict[str, Any],
) -> tuple[MuonConfig, MuonFsdpConfig, dict[str, Any]]:
    """``(MuonConfig, MuonFsdpConfig, the other keywords)`` of flat keywords: ``MuonConfig``
    fields (unnamed ones at ``TensorParallelMuon``'s defaults), ``MuonFsdpConfig`` fields, and
    the rest (``dp_group=``, ... for ``ShardedMuon`` itself, which refuses an unknown one)."""
    muon = {k: v for k, v in keywords.items() if k in _MUON_FIELDS}
    fsdp = {k: v for k, v in keywords.items() if k in _FSDP_FIELDS}
    others = {k: v for k, v in keywords.items() if k not in _MUON_FIELDS | _FSDP_FIELDS}
    muon_config = MuonConfig(**{**_TENSOR_PARALLEL_MUON_DEFAULTS, **muon})
    return muon_config, MuonFsdpConfig(**fsdp), others


def deprecated_flat_keywords(
    keywords: dict[str, Any], muon: MuonConfig | None, fsdp: MuonFsdpConfig | None
) -> tuple[MuonConfig, MuonFsdpConfig]:
    """The two configs of 0.1's constructor keywords, after a ``DeprecationWarning`` naming the
    new form; a config passed whole (``muon=``, ``fsdp=``) is kept.

    Raises:
        TypeError: a keyword that is no ``MuonConfig`` or ``MuonFsdpConfig`` field, or a field of
            a config that was also passed whole (``muon=`` with ``momentum=``).
    """
    unknown = sorted(set(keywords) - _MUON_FIELDS - _FSDP_FIELDS)
    if unknown:
        raise TypeError(f"ShardedMuon got unexpected keyword argument(s) {unknown}")
    for config, names, label in ((muon, _MUON_FIELDS, "muon"), (fsdp, _FSDP_FIELDS, "fsdp")):
        both = sorted(set(keywords) & names)
        if config is not None and both:
            raise TypeError(f"ShardedMuon got {label}= and its fields {both} as keywords; pass one")
    warnings.warn(
        f"ShardedMuon(params, {', '.join(f'{k}=...' for k in keywords)}) is deprecated and will "
        "be removed in 0.3.0: pass muon=MuonConfig(...) and fsdp=MuonFsdpConfig(...), or call "
        "ShardedMuon.from_keywords(params, ...) with the same keywords",
        DeprecationWarning,
        stacklevel=3,
    )
    muon_config, fsdp_config, _ = configs_of_keywords(keywords)
    return muon or muon_config, fsdp or fsdp_config

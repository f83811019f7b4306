"""Deprecated: the module paths of megatron-muon 0.1. ``megatron_muon.sharded`` was split into
``megatron_muon.engine`` (the owner engine) and ``megatron_muon.optimizers`` (the optimizers on
it) in 0.2.0. Importing an old path, e.g. ``megatron_muon.sharded.sharded_muon``, still works for
this release: it warns (``DeprecationWarning`` naming the new path) and gives the new module
itself, so classes and functions are the same objects. Removed in 0.3.0."""

from __future__ import annotations

from megatron_muon.common.moved_modules import alias_moved_modules

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


__getattr__ = alias_moved_modules(__name__, MOVED, removed_in="0.3.0")

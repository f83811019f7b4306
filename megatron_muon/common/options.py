"""The allowed values of megatron-muon's string options, each defined once as a ``Literal`` alias.

The config dataclasses that hold an option (``engine.config.MuonConfig``,
``engine.config.MuonFsdpConfig``, ``newton_schulz.methods.NSConfig``) check it with
``check_choice`` against its alias, and the command-line flags (``fsdp.arguments``) take
``typing.get_args`` of the config field's alias as their choices (as megatron-core does for its own
``Literal`` options). The NS methods (``NSMethodT``) are defined with their registry in
``newton_schulz/methods.py``, so that a new method is one entry in one file.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

__all__ = [
    "FsdpModeT",
    "FsdpOptimizerT",
    "GramHalfDtypeT",
    "MegatronMatmulPrecT",
    "MegatronOptimizerT",
    "MuonScaleT",
    "OrthogonalizedOptimizerT",
    "RowwiseOptimizerT",
    "ScalarOptimizerT",
    "TpModeT",
    "check_choice",
]

# Where Newton-Schulz runs on Megatron-FSDP's row shards (``--muon-fsdp-mode``).
FsdpModeT = Literal["owner", "gather"]
# How a tensor-parallel matrix is orthogonalized (``--muon-tp-mode``): TensorParallelMuon's three
# modes, and "layer_sharded" (megatron-muon's; Megatron-LM's name from its open PR): each unsplit
# matrix orthogonalized once over the whole DP x TP grid (``engine.tp_grid``), never given to
# TensorParallelMuon.
TpModeT = Literal["blockwise", "duplicated", "distributed", "layer_sharded"]
# Muon's update scale (``--muon-scale-mode``; emerging-optimizers' ``get_muon_scale_factor``).
MuonScaleT = Literal["spectral", "unit_rms_norm", "shape_scaling"]
# The optimizer of the params Muon does not take (``--muon-scalar-optimizer``).
ScalarOptimizerT = Literal["adam", "lion"]
# Gram Newton-Schulz's matmul dtype under "medium" fp32 matmul precision.
GramHalfDtypeT = Literal["float16", "bfloat16"]
# Megatron-LM's --muon-fp32-matmul-prec values (``ShardedMuon`` also takes torch's "highest").
MegatronMatmulPrecT = Literal["low", "medium", "high"]
# The ``OptimizerConfig.optimizer`` values megatron-muon builds for Megatron-FSDP
# (``fsdp.factory.build_muon_optimizer``; ``install()`` routes these with --use-megatron-fsdp and
# widens Megatron-LM's --optimizer choices to them). ``RowwiseOptimizerT``: those whose step runs
# on each rank's rows (``fsdp.rowwise_optimizers``).
RowwiseOptimizerT = Literal["laprop", "oblique_sgd", "oblique_adam"]
FsdpOptimizerT = Literal[
    "muon", "adaptive_muon", "lion", "soap", "psgd_pro", "rekls", RowwiseOptimizerT
]
# The --optimizer values of our copy of Megatron-LM's flag (``fsdp.arguments``): megatron-core's
# own adam and sgd, and ours (``fsdp.optimizer_registry`` has an entry for each).
MegatronOptimizerT = Literal["adam", "sgd", FsdpOptimizerT]
# The other orthogonalized optimizers of emerging-optimizers 0.3.0 (its registry names, which
# megatron-core's ``OptimizerConfig.optimizer`` takes), built by ``fsdp.factory`` for a custom
# trainer (``optimizers.orthogonalized``); Megatron-LM's --optimizer flag does not offer them.
OrthogonalizedOptimizerT = Literal[
    "polargrad", "scion", "mop", "spel", "muon_hyperball", "sinkhorn_muon"
]


def check_choice(name: str, value: Any, alias: Any) -> None:
    """Raises ``ValueError("<name> must be one of (...), got <value>")`` unless ``value`` is one of
    the ``Literal`` alias's values."""
    choices = get_args(alias)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")

"""megatron-muon: exact, fast Muon for models trained with Megatron-FSDP."""

__version__ = "0.1.0"

from megatron_muon.sharded_muon import ShardedMuon, StepStats

__all__ = ["ShardedMuon", "StepStats"]

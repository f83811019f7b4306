"""megatron-muon: exact, fast Muon for models trained with Megatron-FSDP."""

__version__ = "0.2.0"

from megatron_muon.checkpointing import load_checkpoint, save_checkpoint
from megatron_muon.engine.config import MuonConfig, MuonFsdpConfig
from megatron_muon.fsdp.factory import build_muon_optimizer, get_megatron_muon_optimizer
from megatron_muon.fsdp.qk_clip import QKClipConfig
from megatron_muon.fsdp.step_wrapper import FsdpStepWrapper
from megatron_muon.optimizers.muon import ShardedMuon, StepStats

__all__ = [
    "FsdpStepWrapper",
    "MuonConfig",
    "MuonFsdpConfig",
    "QKClipConfig",
    "ShardedMuon",
    "StepStats",
    "build_muon_optimizer",
    "get_megatron_muon_optimizer",
    "load_checkpoint",
    "save_checkpoint",
]

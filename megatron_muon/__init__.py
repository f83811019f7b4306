"""megatron-muon: exact, fast Muon for models trained with Megatron-FSDP."""

__version__ = "0.1.0"

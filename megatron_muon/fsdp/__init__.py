"""Muon for Megatron-FSDP models: the factory, routing, process groups, the step wrapper and grad
sync, the chained optimizer, QK-clip, our flags. May import ``checkpointing``, ``optimizers``,
``engine``, ``newton_schulz`` and ``common``."""

"""The pretrain entry point's parts (``python -m megatron_muon.pretrain``): its arguments, presets,
data. May import every layer below (``integrations``, ``fsdp``, ..., ``cpu_stand_ins``)."""

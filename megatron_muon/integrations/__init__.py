"""megatron-muon in other training loops: Megatron-LM (``megatron_lm``), Megatron-Bridge
(``megatron_bridge``); the only patches of Megatron. May import ``fsdp`` and below and
``cpu_stand_ins``."""

"""megatron-muon in other training loops: Megatron-LM (``megatron_lm``), Megatron-Bridge
(``megatron_bridge``); the only patches of Megatron. May import ``fsdp`` and below and
``cpu_stand_ins``."""

from megatron_muon.common.moved_modules import alias_moved_modules

# The checkpoint guards' module paths before 0.3.0 -> their modules in ``checkpoint_guards``.
MOVED = {
    "checkpoint_guard": "megatron_muon.integrations.checkpoint_guards.adam_state",
    "checkpoint_integrity": "megatron_muon.integrations.checkpoint_guards.integrity",
    "checkpoint_optimizer_kind": "megatron_muon.integrations.checkpoint_guards.optimizer_kind",
    "checkpoint_pickles": "megatron_muon.integrations.checkpoint_guards.pickles",
    "checkpoint_vocab": "megatron_muon.integrations.checkpoint_guards.vocab",
    "megatron_checkpoint": "megatron_muon.integrations.checkpoint_guards.load_directory",
    "megatron_bridge_checkpoint": "megatron_muon.integrations.checkpoint_guards.bridge",
}
__getattr__ = alias_moved_modules(__name__, MOVED, removed_in="0.4.0")

"""``ShardedMuon`` on Megatron-FSDP row shards: row layout, tensor parallelism, QKV, momentum
offload, the step plan and planner, the owner pipeline and its exchanges, the configs. May import
``newton_schulz`` and ``common``."""

"""The owner engine: how full matrices are brought together from Megatron-FSDP row shards, worked
on by one owner rank (or a block of ranks) and sent back as rows. It knows no optimizer: an
optimizer in ``megatron_muon.optimizers`` says what it needs of it (whole matrices or rows,
owner-held state or not, its per-matrix math).

Row layout (``layout``), TP groups and grids (``tensor_parallel``, ``tp_grid``), fused QKV
(``qkv``), the planner and the static step plan (``planner``, ``step_plan``, ``optimizer_plan``),
the exchange buckets (``bucket_cuts``, ``bucket_schedule``), the exchanges (``exchange``,
``gather_exchange``), the per-bucket pipeline (``owner_pipeline``), the NS runner (``ns_runner``),
owner-held state (``owner_state``), momentum offload (``momentum_offload``) and the configs
(``config``). May import ``newton_schulz`` and ``common``."""

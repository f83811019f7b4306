"""``python -m megatron_muon.plan``: per-GPU NS work, bytes and memory of a model at a layout, for
every way of placing NS work. May import ``engine``, ``newton_schulz`` and ``common``."""

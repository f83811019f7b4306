"""The checks a checkpoint passes before Megatron-LM or Megatron-Bridge reads it, and the state
that makes a save possible at all.

- ``load_directory``: the ``iter_XXXXXXX`` directory a ``--load`` reads.
- ``pickles``: every pickle of an ``fsdp_dtensor`` checkpoint read restricted (no code runs).
- ``integrity``: a failed save stops every rank with one error; files hashed; a damaged checkpoint
  refused before it loads.
- ``optimizer_kind``: another optimizer's state refused naming both.
- ``vocab``: another vocabulary padding refused naming the flag.
- ``bridge``: Megatron-Bridge's loads, checked as Megatron-LM's.
- ``adam_state``: Adam's state on every rank, so its ``fsdp_dtensor`` save does not hang.

Up to 0.2.0 these were ``megatron_muon.integrations.checkpoint_*`` (and ``megatron_checkpoint``,
``megatron_bridge_checkpoint``); those paths still import, with a ``DeprecationWarning``.
"""

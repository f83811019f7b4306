"""The checks a checkpoint passes before Megatron-LM or Megatron-Bridge reads it, and the state
that makes a save possible at all.

The doors a checkpoint comes in through, and what checks each (docs/reliability.md, Security):

- Megatron-LM's ``load_checkpoint`` (``megatron.training.training``'s name, which ``pretrain``
  and the RL reference model's load call, and ``megatron.training.checkpointing``'s):
  ``--load``; ``--pretrained-checkpoint`` when ``--load`` holds no checkpoint (``--finetune`` or
  not; the RL reference load sets ``args.load = None`` to get there); ``--ckpt-step``;
  non-persistent checkpoints. Checked by ``readers`` (wired by ``pickles``), then for
  ``--load`` ``integrity`` (Muon on Megatron-FSDP, ``fsdp_dtensor``: files and hashes),
  ``vocab`` and ``optimizer_kind`` (``fsdp_dtensor``).
- Megatron-LM's ``load_args_from_checkpoint`` (``--use-checkpoint-args``, before
  ``torch.distributed`` starts): ``readers`` (wired by ``pickles``), in each process.
- Megatron-Bridge's ``_load_checkpoint_from_path`` (resume, ``pretrained_checkpoint``, PEFT) and
  ``has_modelopt_state`` / ``load_modelopt_state`` (``restore_modelopt_state``, while the model
  is built): ``readers``' checks on the directories Bridge resolves (``bridge``), and
  ``optimizer_kind`` for the resume.
- ``megatron_muon.checkpointing.load_checkpoint``: its own checks (``checkpointing.files``,
  ``checkpointing.safe_unpickle``), not this package.

The modules:

- ``load_directory``: the directories Megatron's loads read (``--load`` or
  ``--pretrained-checkpoint``, the tracker, ``--ckpt-step`` as Megatron reads it).
- ``readers``: the one guard: the reader Megatron picks from the files, every pickle it would
  read, read restricted (``checkpointing.safe_unpickle``: ``.metadata`` by
  ``checkpointing.metadata_unpickler``, storage references confined by
  ``checkpointing.confined_files``); a format not read restricted refused by name.
- ``pickles``: Megatron-LM's doors through ``readers``, then DCP's reads restricted during the
  load; ``--ckpt-trust-pickles`` the one opt-out.
- ``integrity``: a failed save stops every rank with one error; files hashed; a damaged checkpoint
  refused before it loads.
- ``optimizer_kind``: another optimizer's state refused naming both.
- ``vocab``: another vocabulary padding refused naming the flag.
- ``bridge``: Megatron-Bridge's doors, checked as Megatron-LM's.
- ``adam_state``: Adam's state on every rank, so its ``fsdp_dtensor`` save does not hang.

Up to 0.2.0 these were ``megatron_muon.integrations.checkpoint_*`` (and ``megatron_checkpoint``,
``megatron_bridge_checkpoint``); those paths still import, with a ``DeprecationWarning``, until
0.4.0.
"""

"""The optimizers on Megatron-FSDP row shards, each a short composition of ``megatron_muon.engine``
parts around its own unsharded class (emerging-optimizers' or megatron-core's): ``muon``
(``ShardedMuon``), ``adaptive_muon`` (with ``moment2_partitions``), ``orthogonalized`` (with
``orthogonalized_adapters``), ``soap`` (with ``soap_matrix``, ``soap_plan``), ``laprop`` and
``oblique`` (steps on each rank's rows; their settings read as ``settings`` says). May import
``engine``, ``newton_schulz`` and ``common``; the engine never imports an optimizer."""

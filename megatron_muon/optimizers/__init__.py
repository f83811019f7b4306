"""The optimizers on Megatron-FSDP row shards, each a short composition of ``megatron_muon.engine``
parts around its own unsharded class (emerging-optimizers' or megatron-core's):

- on the owner pipeline (NS of each whole matrix on its owner): ``muon`` (``ShardedMuon``;
  ``muon_keywords``), ``adaptive_muon`` (``adaptive_muon_config``, ``moment2_partitions``),
  ``orthogonalized`` (``orthogonalized_adapters``);
- owner-computed (each matrix's state and work on one owner, ``engine.owner_compute``): ``soap``
  (``soap_matrix``, ``soap_plan``), ``rekls``, ``psgd_pro`` (``psgd_matrix``);
- on each rank's rows: ``laprop``, ``oblique``.

``settings`` reads an optimizer's settings beyond megatron-core's ``OptimizerConfig``. May import
``engine``, ``newton_schulz`` and ``common``; the engine never imports an optimizer."""

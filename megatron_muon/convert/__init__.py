"""``python -m megatron_muon.convert``: a checkpoint of megatron-core's DDP (``torch_dist``) as
Megatron-FSDP's ``fsdp_dtensor``, and back: Adam, and Muon (megatron-core's LayerWise, ours).
May import ``checkpointing`` and ``common``.

One offline process: both formats hold global tensors (every TP, EP and DP shard a chunk of one
global tensor in DCP's metadata), so one process reads any layout's checkpoint whole and writes one
that any layout loads; no GPU, no process group. docs/checkpoints.md says what is exact and what is
refused.

Modules, one concept each:

- ``names``: the two formats' keys and the model-space name between them;
- ``model_space``: ``ModelSpace`` (what a conversion carries), ``ConversionRefused``;
- ``dcp_files``: a DCP directory read and written in one process, pickles read restricted;
- ``torch_dist`` / ``fsdp_dtensor``: each format read into model space and written from it;
- ``layer_wise``: megatron-core's own Muon (``LayerWiseDistributedOptimizer``) in ``torch_dist``;
- ``run``: ``convert(...)``: source -> model space -> target, with progress and a summary;
- ``__main__``: the command line.
"""

from __future__ import annotations

from megatron_muon.convert.model_space import ConversionRefused, ModelSpace
from megatron_muon.convert.run import ConversionSummary, convert

__all__ = ["ConversionRefused", "ConversionSummary", "ModelSpace", "convert"]

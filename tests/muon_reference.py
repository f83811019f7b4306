"""The reference the ShardedMuon parity tests compare with: megatron-core's ``TensorParallelMuon``
on full matrices, with the hyperparameters (``MUON_KWARGS``), inputs (``full_tensor``) and
tolerance (``TOLERANCE``) those tests share.
"""

from __future__ import annotations

import torch

TOLERANCE = 1e-6
MUON_KWARGS = dict(
    lr=0.02,
    momentum=0.9,
    nesterov=True,
    weight_decay=0.05,
    fp32_matmul_prec="highest",
    coefficient_type="quintic",
    num_ns_steps=5,
    scale_mode="spectral",
    tp_mode="blockwise",
)


def full_tensor(shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

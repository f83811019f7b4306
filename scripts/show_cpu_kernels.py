"""Prints which CPU kernels torch uses here, and a fingerprint of what they compute.

``make test-avx2`` runs it with the AVX2 limits set, before the parity tests: the fingerprints
(hashes of an fp32 matmul, a bf16 matmul and a softmax, each on fixed random inputs) differ from
an unlimited run's on a CPU with AVX-512, which shows the limits took effect. Compare with
``.venv/bin/python scripts/show_cpu_kernels.py`` run without them.
"""

from __future__ import annotations

import hashlib
import os

import torch


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.float().contiguous().numpy().tobytes()).hexdigest()[:10]


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(333, 517, generator=generator)
    b = torch.randn(517, 229, generator=generator)
    limits = {
        name: os.environ.get(name, "-")
        for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
    }
    print(
        f"cpu kernels: aten {torch.backends.cpu.get_cpu_capability()}, limits {limits}; "
        f"fp32 matmul {_digest(a @ b)}, bf16 matmul {_digest(a.bfloat16() @ b.bfloat16())}, "
        f"softmax {_digest(torch.softmax(a, dim=1))}"
    )


if __name__ == "__main__":
    main()

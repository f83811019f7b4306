"""Prints which CPU kernels torch uses here, and a fingerprint of what they compute.

``make test-avx2`` runs it with the AVX2 limits set, before the parity tests: the fingerprints
(hashes of an fp32 matmul, a bf16 matmul and a softmax, each on fixed random inputs) differ from
an unlimited run's on a CPU with AVX-512, which shows the limits took effect. Compare with
``.venv/bin/python scripts/show_cpu_kernels.py`` run without them.

``--compare-unlimited`` also runs itself without the limits and compares: exit 0 when the limits
change the kernels (the AVX2 pass computes something the unlimited pass did not), exit 3 when
they change nothing (a CPU without AVX-512, such as AMD Zen 3: its unlimited run already computed
with these kernels, and ``make test-avx2`` has nothing left to check).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import torch

LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
UNCHANGED_EXIT = 3


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.float().contiguous().numpy().tobytes()).hexdigest()[:10]


def kernels() -> dict[str, str]:
    """aten's vectorization level and the fingerprints of three ops, in this process."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(333, 517, generator=generator)
    b = torch.randn(517, 229, generator=generator)
    return {
        "aten": str(torch.backends.cpu.get_cpu_capability()),
        "fp32 matmul": _digest(a @ b),
        "bf16 matmul": _digest(a.bfloat16() @ b.bfloat16()),
        "softmax": _digest(torch.softmax(a, dim=1)),
    }


def unlimited_kernels() -> dict[str, str]:
    """``kernels()`` in a process started without ``LIMITS``."""
    env = {name: value for name, value in os.environ.items() if name not in LIMITS}
    done = subprocess.run(
        [sys.executable, __file__, "--json"], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def main() -> int:
    here = kernels()
    if "--json" in sys.argv:
        print(json.dumps(here))
        return 0
    limits = {name: os.environ.get(name, "-") for name in LIMITS}
    print(f"cpu kernels: limits {limits}; " + ", ".join(f"{k} {v}" for k, v in here.items()))
    if "--compare-unlimited" not in sys.argv:
        return 0
    unlimited = unlimited_kernels()
    print("without the limits: " + ", ".join(f"{k} {v}" for k, v in unlimited.items()))
    return 0 if unlimited != here else UNCHANGED_EXIT


if __name__ == "__main__":
    sys.exit(main())

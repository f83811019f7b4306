"""emerging-optimizers' Triton syrk Newton-Schulz (``newton_schulz(..., use_syrk=True)``): where it
runs, and how a batch is run through it.

Megatron-LM main's ``--muon-use-syrk`` runs the standard iteration with its symmetric products
``X X^T`` and ``b A + c A A`` through Triton "extended syrk" kernels (``tsyrk_ex``) instead of
dense matmuls. emerging-optimizers 0.3.0 uses them only under ``"medium"`` fp32 matmul precision
(bf16 iteration; under "high"/"highest" it runs the dense iteration), on 2-D fp32 input, on CUDA,
with Triton >= 3.4; its ``Muon`` class accepts SM 8.0, 9.0, 10.0 and 10.3 only (others: correctness
"cannot be guaranteed") and silently falls back elsewhere. Here a run that asks for it where it
cannot run is refused by name instead (``syrk_problem``), and a batch of same-shape matrices (3-D,
which the kernels refuse) goes through it one matrix at a time.
"""

from __future__ import annotations

import torch
from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

__all__ = ["SYRK_DEVICE_CAPABILITIES", "syrk_newton_schulz", "syrk_problem"]

# The GPUs emerging-optimizers' Muon lets use_syrk run on (its own check, muon.py).
SYRK_DEVICE_CAPABILITIES = ((8, 0), (9, 0), (10, 0), (10, 3))


def syrk_problem(device: torch.device | str | None = None) -> str | None:
    """Why the syrk NS cannot run on ``device`` (default: the current CUDA device, if any) on this
    host, or ``None`` if it can."""
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        return f"it runs Triton kernels on CUDA tensors, and the params are on {device.type}"
    if not torch.cuda.is_available():
        return "it runs Triton kernels on CUDA, and no CUDA device is available"
    try:
        from emerging_optimizers import triton_kernels
    except ImportError as error:  # triton missing
        return f"emerging_optimizers.triton_kernels cannot be imported ({error})"
    if not getattr(triton_kernels, "HAS_TRITON_340", False):
        return "it needs Triton 3.4.0 or later"
    capability = torch.cuda.get_device_capability(device)
    if capability not in SYRK_DEVICE_CAPABILITIES:
        return (
            f"emerging-optimizers vouches for its kernels on SM {SYRK_DEVICE_CAPABILITIES} only, "
            f"this GPU is SM {capability}"
        )
    return None


def syrk_newton_schulz(
    x: torch.Tensor, steps: int, coefficient_type: str, custom_coefficient_sets=None
) -> torch.Tensor:
    """``newton_schulz(x, ..., use_syrk=True)`` of a 2-D ``(M, N)`` or, one matrix at a time, a
    3-D ``(B, M, N)`` fp32 CUDA tensor; fp32 result of the same shape.

    Raises:
        ValueError: ``x`` is not an fp32 CUDA tensor of 2 or 3 dims.
    """
    if not x.is_cuda or x.dtype != torch.float32 or x.ndim not in (2, 3):
        raise ValueError(
            "use_syrk runs on 2-D (or batched 3-D) fp32 CUDA tensors, got "
            f"{x.ndim}-D {x.dtype} on {x.device}"
        )
    if x.ndim == 3:
        return torch.stack(
            [syrk_newton_schulz(m, steps, coefficient_type, custom_coefficient_sets) for m in x]
        )
    return newton_schulz(
        x, steps, coefficient_type, custom_coefficient_sets=custom_coefficient_sets, use_syrk=True
    )

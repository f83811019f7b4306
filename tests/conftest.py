"""Test-wide settings: one thread per process (REFERENCE.md section 1), deterministic seeds."""

import torch

torch.set_num_threads(1)

"""Which device a run computes on, and in what precision there."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from aisyn.validate import check_device


def resolve_device(name: str) -> torch.device:
    check_device(name)  # a clear error, not torch's RuntimeError/AssertionError
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA; plain fp32 on CPU (exact and reproducible)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()

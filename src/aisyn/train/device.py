"""Which device a run computes on, and in what precision there."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from aisyn.train.config import AUTOCAST_MODES
from aisyn.validate import check_device


def resolve_device(name: str) -> torch.device:
    check_device(name)  # a clear error, not torch's RuntimeError/AssertionError
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast_on(device: torch.device, mode: str = "auto") -> bool:
    """Whether a run with ``--autocast mode`` computes in bf16 on ``device``:
    ``auto`` on CUDA only (CPU stays plain fp32: exact and reproducible),
    ``bf16`` anywhere, ``off`` nowhere. The parameters, their gradients and
    AdamW's state stay fp32 either way (the fp32 master weights)."""
    if mode not in AUTOCAST_MODES:
        raise ValueError(f"autocast {mode!r}: use one of {', '.join(AUTOCAST_MODES)}")
    return device.type == "cuda" if mode == "auto" else mode == "bf16"


def autocast_for(device: torch.device, mode: str = "auto"):
    """The bf16 autocast context of ``autocast_on``, or a no-op one."""
    if autocast_on(device, mode):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()

"""Refuse a training run that cannot fit in memory, before it allocates anything.

A batch far too large for the machine otherwise runs until the kernel's OOM
killer ends the process (no message, possibly after minutes of swapping) or
CUDA raises mid-step. The estimate is the split planner's (``model.plan``):
weights + gradients + AdamW state + activations of the micro-batches in flight,
an upper estimate, so a refusal means the run would not fit; the available
memory is what the OS (or the cgroup the process runs in) or CUDA says is free.

``AISYN_SKIP_MEMORY_CHECK=1`` turns the check off for a machine where the
available memory is misreported.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from aisyn.model.families import ModelConfig, build_model
from aisyn.model.plan import (
    DTYPE_BYTES,
    Workload,
    block_activation_bytes,
    format_bytes,
    module_sizes,
    party_load,
)
from aisyn.model.segments import Partition

SKIP_ENV = "AISYN_SKIP_MEMORY_CHECK"


def compute_dtype(device: torch.device) -> str:
    """What the trainers compute in: bf16 autocast on CUDA, fp32 elsewhere."""
    return "bf16" if device.type == "cuda" else "fp32"


def whole_model_bytes(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    in_flight: int = 1,
    *,
    trains_all_weights: bool = True,
) -> float:
    """Training memory of the unsplit model (the planner's formulas, one party).

    Parameters stay fp32 (16-bit compute adds an fp32-equivalent master copy in
    the planner's accounting, which comes to the same 16 bytes a parameter).
    ``trains_all_weights=False`` (LoRA): the frozen weights alone, 4 bytes each.
    """
    params = sum(module_sizes(build_model(cfg, device="meta")).values())
    dt = DTYPE_BYTES[dtype]
    if trains_all_weights:
        state = params * (2 * dt + 8 + (0 if dtype == "fp32" else 4))
    else:
        state = params * 4
    tokens = micro_batch * seq_len
    # every layer (the top query layer counts as a block), the logits in the
    # compute dtype plus the loss's fp32 copy, and the embedding output
    activations = (
        cfg.num_layers * block_activation_bytes(cfg, micro_batch, seq_len, dtype)
        + tokens * cfg.vocab_size * (dt + 4)
        + tokens * cfg.hidden_size * dt
    )
    return state + activations * in_flight


def party_bytes(
    cfg: ModelConfig,
    partition: Partition,
    party: str,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    in_flight: int = 1,
) -> float:
    """Training memory of one party's share of a split model."""
    sizes = module_sizes(build_model(cfg, device="meta"))
    workload = Workload(
        batch_size=micro_batch,
        micro_batch_size=micro_batch,
        seq_len=seq_len,
        dtype=dtype,
        in_flight=in_flight,
    )
    return party_load(sizes, cfg, partition, party, workload).memory_bytes


def _meminfo_available() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


#: (limit, usage, stat file, its page-cache key) of cgroup v2, then v1
_CGROUP_FILES = (
    ("memory.max", "memory.current", "memory.stat", "file"),
    (
        "memory/memory.limit_in_bytes",
        "memory/memory.usage_in_bytes",
        "memory/memory.stat",
        "total_cache",
    ),
)


def cgroup_available(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """Room left under this process's cgroup memory limit; None without one.

    Usage counts the page cache, which the kernel drops before it kills
    anything, so it is left out (as MemAvailable leaves it out).
    """
    for limit_file, usage_file, stat_file, cache_key in _CGROUP_FILES:
        try:
            limit_text = (root / limit_file).read_text().strip()
            if limit_text == "max":  # v2: no limit
                return None
            limit = float(limit_text)
            if limit >= 2**60:  # v1: no limit
                return None
            usage = float((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        cache = 0.0
        try:
            for line in (root / stat_file).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == cache_key:
                    cache = float(value)
        except (OSError, ValueError):
            pass
        return max(0.0, limit - max(0.0, usage - cache))
    return None


def available_bytes(device: torch.device) -> float | None:
    """Free memory for a run on ``device``; None where it cannot be told."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return float(free)
    if device.type != "cpu":
        return None
    known = [b for b in (_meminfo_available(), cgroup_available()) if b is not None]
    return min(known) if known else None


def check_fits(needed: float, device: torch.device, what: str) -> None:
    """Raise ``ValueError`` if ``needed`` bytes exceed what ``device`` has free
    (no check when that is unknown or the user turned it off)."""
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return
    free = available_bytes(device)
    if free is None or needed <= free:
        return
    raise ValueError(
        f"{what} needs about {format_bytes(needed)} of memory on {device} "
        f"(estimate), but only {format_bytes(free)} is available; lower "
        f"--micro-batch-size (or --batch-size), or set {SKIP_ENV}=1 to try anyway"
    )

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

import torch

from aisyn.model.capacity import (  # noqa: F401  (cgroup_available: re-exported)
    SKIP_ENV,
    available_bytes,
    cgroup_available,
    memory_check_skipped,
)
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


def check_fits(needed: float, device: torch.device, what: str) -> None:
    """Raise ``ValueError`` if ``needed`` bytes exceed what ``device`` has free
    (no check when that is unknown or the user turned it off)."""
    if memory_check_skipped():
        return
    free = available_bytes(device)
    if free is None or needed <= free:
        return
    raise ValueError(
        f"{what} needs about {format_bytes(needed)} of memory on {device} "
        f"(estimate), but only {format_bytes(free)} is available; lower "
        f"--micro-batch-size (or --batch-size), or set {SKIP_ENV}=1 to try anyway"
    )

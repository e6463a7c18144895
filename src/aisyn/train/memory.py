"""Refuse a training run that cannot fit in memory, before it allocates anything.

A batch far too large for the machine otherwise runs until the kernel's OOM
killer ends the process (no message, possibly after minutes of swapping) or
CUDA raises mid-step. The estimate is the split planner's (``model.memory``):
the step's peak of runtime, weights, AdamW state, gradients and the
activations of the micro-batches in flight; the available
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
from aisyn.model.cost import format_bytes, module_sizes
from aisyn.model.families import ModelConfig, build_model
from aisyn.model.memory import Workload, party_load, rank_load
from aisyn.model.segments import Partition


def whole_model_bytes(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    dtype: str = "fp32",
    in_flight: int = 1,
    *,
    trains_all_weights: bool = True,
    autocast: bool = False,
    activation_checkpointing: bool = False,
    shard: tuple[int, int] | None = None,
) -> float:
    """Peak training memory of the unsplit model: the planner's formula
    (``model.memory.rank_load``) for one process holding every piece.

    ``autocast``: bf16 autocast over fp32 parameters; ``trains_all_weights=
    False`` (LoRA): the frozen weights alone, no gradients or AdamW state;
    ``shard=(k, R)``: rank k of R holding FSDP2 shards (``micro_batch``: the
    rows of all R ranks together); the embedding and head are counted whole,
    an upper bound.
    """
    sizes = _sizes(cfg)
    w = _workload(
        micro_batch, seq_len, dtype, in_flight, autocast, activation_checkpointing
    )
    blocks = list(range(cfg.num_blocks))
    r = rank_load(sizes, cfg, w, blocks, embed=True, head=True, shard=shard)
    if not trains_all_weights:
        r.grads_bytes = r.optimizer_bytes = 0.0
    return r.memory_bytes


def party_bytes(
    cfg: ModelConfig,
    partition: Partition,
    party: str,
    micro_batch: int,
    seq_len: int,
    dtype: str = "fp32",
    in_flight: int = 1,
    *,
    autocast: bool = False,
    activation_checkpointing: bool = False,
) -> float:
    """Peak training memory of one party's share of a split model (what
    ``aisyn split plan`` prints for it at batch = micro-batch)."""
    w = _workload(
        micro_batch, seq_len, dtype, in_flight, autocast, activation_checkpointing
    )
    return party_load(_sizes(cfg), cfg, partition, party, w).memory_bytes


def rank_bytes(
    cfg: ModelConfig,
    partition: Partition,
    party: str,
    ranks: int,
    micro_batch: int,
    seq_len: int,
    micro_batches: int = 1,
    *,
    schedule: str = "gpipe",
    in_flight: int = 1,
    dtype: str = "fp32",
    autocast: bool = False,
    activation_checkpointing: bool = False,
) -> list[float]:
    """Peak training memory of each of ``ranks`` ranks of ``party``, in the
    layout its torchrun job runs (``model.memory.party_layout``): what ``aisyn
    split plan --party NAME:...:RxMEM`` prints per rank.

    * the compute party on up to one rank per layer: pipeline stages
      (``model.cost.pipeline_stage_blocks``), holding ``micro_batches``
      micro-batches a step under ``schedule`` (``window``: ``in_flight`` each);
    * the data party on more than one rank, or the compute party on more
      ranks than layers: the blocks FSDP2-sharded over the ranks, the
      embedding and head whole on each, every rank holding the activations
      of its rows (``ceil(micro_batch / ranks)`` on rank 0) of ``in_flight``
      micro-batches (the link's window: ``--pipeline`` + 1).

    ``micro_batch`` is a micro-batch's rows over all the ranks; ``dtype`` the
    parameters' (``autocast``: bf16 autocast over fp32). PlanError if the
    layout cannot run it (a sharded party's micro-batch with fewer rows than
    ranks)."""
    w = _workload(
        micro_batch,
        seq_len,
        dtype,
        in_flight,
        autocast,
        activation_checkpointing,
        micro_batches,
        schedule,
    )
    load = party_load(_sizes(cfg), cfg, partition, party, w, devices=ranks)
    return [r.memory_bytes for r in load.ranks]


def _sizes(cfg: ModelConfig) -> dict[str, int]:
    """Parameters per module of ``cfg``'s model, built on the meta device."""
    return module_sizes(build_model(cfg, device="meta"))


def _workload(
    micro_batch: int,
    seq_len: int,
    dtype: str,
    in_flight: int,
    autocast: bool,
    activation_checkpointing: bool,
    micro_batches: int = 1,
    schedule: str = "gpipe",
) -> Workload:
    """One step of ``micro_batches`` micro-batches of ``micro_batch`` rows."""
    return Workload(
        batch_size=micro_batch * micro_batches,
        micro_batch_size=micro_batch,
        schedule=schedule,
        seq_len=seq_len,
        dtype=dtype,
        in_flight=in_flight,
        autocast=autocast,
        activation_checkpointing=activation_checkpointing,
    )


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

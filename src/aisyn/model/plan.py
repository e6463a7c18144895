"""Pick where to cut a model between two parties, from their compute and memory.

Everything is arithmetic on the model's shape: parameter counts come from the
model built on the meta device (so they are the model's own, for any preset up
to 200B, without allocating a byte); FLOPs and memory from the standard
transformer formulas below. Nothing here runs the model.

Per token, forward, for hidden size h, FFN size f, vocabulary V, sequence T:

* ordinary block: ``2 * (4h² + 2hf)`` matmul FLOPs + ``4Th`` for attention
  (scores and weighted sum, full T x T as CPU SDPA computes it);
* top query layer: the same as a block;
* tied head: ``2hV``; embeddings: lookups, counted as 0.

Training is 3x forward (backward = 2x forward).

Memory, per rank of a party, is the peak of one optimizer step:

    runtime + weights + grads + optimizer + gathered block + autocast cache
    + activations

A party on R devices is laid out as it runs (``party_layout``):

* ``one`` (R = 1): one process holds the party's layers whole.
* ``pipeline`` (the compute party B, R <= its layers): R pipeline stages
  (``pipeline_stage_blocks``), each holding its stage's layers whole
  (``split.backbone.pipeline.PipelinedRounds``).
* ``sharded`` (B with more devices than layers, ``split.backbone.pipeline.
  ShardedRounds``; the data party A on any R > 1, ``split.client.data_ranks``): the
  party's ordinary blocks FSDP2-sharded over all R ranks (``split.sharding.
  shard_blocks``). Rank k keeps FSDP2's dim-0 chunk k (``torch.chunk``:
  ``ceil(d0 / R)`` rows of each parameter, fewer on the last ranks, so the
  ranks' shares sum to the blocks exactly; FSDP2's padding of the last
  chunks is not counted) of every block's weights and AdamW moments, plus,
  while it runs a block, that block's whole weights (FSDP2's all-gather: one
  block counted, ``gathered``). A's gradients are reduce-scattered every
  backward, so they are sharded like the weights; B's accumulate unsharded
  over the step's micro-batches and are reduce-scattered in its last
  backward only, so a rank of B holds the whole blocks' gradients. The
  party's other pieces (the "ends": embedding and position embeddings,
  final norm, head and PanGu-α's top query layer) stay whole on every rank
  with their gradients and AdamW state. Every rank runs its share of each
  micro-batch's rows (``torch.tensor_split``: ``ceil(mb / R)`` on the first
  ranks), so a micro-batch needs at least R rows, and it holds the
  activations of its rows of the link's window of micro-batches
  (``Workload.in_flight``) for every layer it runs, the head's logits
  included.

weights and gradients in the parameter dtype; AdamW moments (2 x fp32, plus
an fp32 master copy when parameters are 16-bit); under bf16 autocast a bf16
copy of every matrix the blocks multiply by (autocast's cache, held until the
step's backward ends); ``runtime`` is what a training process holds besides
its model (``RUNTIME_BYTES``). Backward frees each block's activations as it
allocates that block's gradients, but on CPU glibc keeps the freed heap
memory resident, so a process's peak RSS is the sum (measured on 350M's
width: within 1 % of VmHWM for 6 blocks); a caching GPU allocator reuses
some of it, so there the sum is an upper estimate.

Activations are the tensors autograd saves, counted for the PanGu-α block
(``block_activation_bytes``, checked against ``saved_tensors_hooks`` in the
tests): eight (B, T, h) and two (B, T, f) tensors per block, the fused
attention kernel keeping no T x T scores; other families keep the upper
estimate of Korthikanti et al. (2022) without recomputation, ``bT h (34 +
5aT/h)`` bytes at 16 bits. With activation checkpointing a block keeps only
its input, plus one block's activations while it is recomputed. A pipeline
stage holds the activations of the micro-batches in flight there: all ``m`` of
a step under GPipe, ``min(m, R - k)`` at stage k under 1F1B.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field, replace

from aisyn.model.families import ModelConfig, build_model
from aisyn.model.segments import (
    COMPUTE_PARTY,
    DATA_PARTY,
    PARTIES,
    Partition,
    Stage,
)

log = logging.getLogger(__name__)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: what a training process holds besides its model's tensors: the peak RSS of
#: ``aisyn train``, ``aisyn split train`` and ``aisyn split serve`` of the tiny
#: preset (the interpreter, torch 2.13 CPU, grpc, the data, the first step's
#: kernels, the loss plot), 345-375 MiB measured, less the planner's 3-33 MiB
#: for tiny's own tensors (``bench/scale.py``). A CUDA context adds its own.
RUNTIME_BYTES = 360 * 2**20
#: pipeline schedules whose activation memory the planner knows: GPipe (all
#: forwards, then all backwards: every stage holds every micro-batch), 1F1B
#: (stage k of R holds at most R - k), and the link's window (every stage
#: runs the order of a one-device party for A's ``--pipeline`` window, as
#: ``aisyn split serve`` under torchrun does: each holds ``in_flight``)
SCHEDULES = ("gpipe", "1f1b", "window")
#: how a party's layers lie on its devices (``party_layout``; the module
#: docstring describes each)
LAYOUTS = ("one", "pipeline", "sharded")
#: wire bytes per element of a cut tensor for each link codec (int8: one byte
#: plus one fp32 scale per 64 values)
CODEC_BYTES = {"none": None, "fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 64}


class PlanError(ValueError):
    """Bad planner input, or no cut fits the parties' memory."""


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> float:
    """``80GB``, ``24GiB``, ``512MB``, ``inf`` -> bytes."""
    t = text.strip().lower()
    if t in ("inf", "unlimited"):
        return math.inf
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?", t)
    if not m:
        raise PlanError(f"memory {text!r}: expected e.g. 80GB, 24GiB, 512MB or inf")
    return float(m.group(1)) * _UNITS[m.group(2) or ""]


def format_bytes(n: float) -> str:
    if math.isinf(n):
        return "unlimited"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class PartySpec:
    """A party's relative throughput (any unit, the same for both; the whole
    party's) and its devices: ``devices`` of ``memory_bytes`` each."""

    name: str
    throughput: float
    memory_bytes: float
    devices: int = 1

    @classmethod
    def parse(cls, text: str) -> PartySpec:
        parts = text.split(":")
        if len(parts) != 3:
            raise PlanError(
                f"--party {text!r}: expected NAME:THROUGHPUT:MEMORY, e.g. A:1:32GB "
                "or B:4:8x80GB (8 devices of 80 GB)"
            )
        name, thr, mem = parts
        if name not in PARTIES:
            raise PlanError(
                f"--party {text!r}: name must be A (data party) or B (compute party)"
            )
        try:
            throughput = float(thr)
        except ValueError:
            raise PlanError(
                f"--party {text!r}: throughput {thr!r} is not a number"
            ) from None
        if not throughput > 0 or math.isinf(throughput):
            raise PlanError(f"--party {text!r}: throughput must be positive")
        devices = 1
        m = re.fullmatch(r"\s*([0-9]+)\s*[x×]\s*(.+)", mem)
        if m:
            devices = int(m.group(1))
            if not 1 <= devices <= 1 << 20:
                raise PlanError(
                    f"--party {text!r}: device count {devices} must be 1 to {1 << 20}"
                )
            mem = m.group(2)
        try:
            memory = parse_bytes(mem)
        except PlanError as e:
            raise PlanError(f"--party {text!r}: {e}") from None
        return cls(name, throughput, memory, devices)

    @property
    def label(self) -> str:
        each = format_bytes(self.memory_bytes)
        return each if self.devices == 1 else f"{self.devices} x {each}"


@dataclass(frozen=True)
class Workload:
    batch_size: int = 8  # samples per optimizer step
    micro_batch_size: int = 1
    seq_len: int | None = None  # None: the model's
    dtype: str = "fp32"  # parameters, gradients and activations
    codec: str = "none"  # cut-layer compression on the link
    in_flight: int = 1  # micro-batches a one-device party holds at once
    eod_reset: bool = False
    autocast: bool = False  # bf16 autocast over fp32 parameters (dtype fp32)
    activation_checkpointing: bool = False  # blocks recompute in backward
    schedule: str = "gpipe"  # of a party's pipeline stages (``SCHEDULES``)
    runtime_bytes: float = RUNTIME_BYTES  # per process (``RUNTIME_BYTES``)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            known = ", ".join(DTYPE_BYTES)
            raise PlanError(f"dtype {self.dtype!r}: use one of {known}")
        if self.codec not in CODEC_BYTES:
            known = ", ".join(CODEC_BYTES)
            raise PlanError(f"codec {self.codec!r}: use one of {known}")
        if self.batch_size < 1 or self.micro_batch_size < 1:
            raise PlanError("batch and micro-batch sizes must be >= 1")
        if self.batch_size % self.micro_batch_size:
            raise PlanError(
                f"micro-batch size {self.micro_batch_size} must divide batch size "
                f"{self.batch_size}"
            )
        if self.in_flight < 1:
            raise PlanError("in_flight must be >= 1")
        if self.autocast and self.dtype != "fp32":
            raise PlanError(
                f"autocast keeps fp32 parameters: it needs dtype fp32, not "
                f"{self.dtype} (which already computes in {self.dtype})"
            )
        if self.schedule not in SCHEDULES:
            known = ", ".join(SCHEDULES)
            raise PlanError(f"schedule {self.schedule!r}: use one of {known}")
        if not self.runtime_bytes >= 0 or math.isinf(self.runtime_bytes):
            raise PlanError("runtime_bytes must be finite and >= 0")

    @property
    def micro_batches(self) -> int:
        return self.batch_size // self.micro_batch_size

    @property
    def wire_bytes_per_value(self) -> float:
        return CODEC_BYTES[self.codec] or float(DTYPE_BYTES[self.dtype])

    @property
    def act_dtype(self) -> str:
        """The dtype the blocks compute in."""
        return "bf16" if self.autocast else self.dtype


@dataclass
class RankLoad:
    """What one device of a party holds at the peak of a step."""

    rank: int
    #: the party's blocks here (``pipeline_stage_blocks``), whole or (``shard``)
    #: a shard of each
    blocks: tuple[int, ...]
    #: [embedding or "", head label or ""]
    head_pieces: list[str] = field(default_factory=lambda: ["", ""])
    params: int = 0  # held here: the whole pieces, and its shards of the blocks
    in_flight: int = 1  # micro-batches whose activations it holds
    weights_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0  # AdamW moments (+ fp32 master)
    cache_bytes: float = 0.0  # autocast's bf16 copies of the weights
    activation_bytes: float = 0.0
    runtime_bytes: float = 0.0
    #: (k, R): the blocks are FSDP2-sharded over R ranks, this is rank k;
    #: None: they are whole here
    shard: tuple[int, int] | None = None
    shard_params: int = 0  # of ``params``: its dim-0 chunks of the blocks'
    gathered_bytes: float = 0.0  # one block's whole weights, all-gathered
    rows: int = 0  # of each micro-batch, whose activations it holds

    def describe(self) -> str:
        """``embedding + h[0:3] + h[29:31] + head``."""
        return _pieces(self)

    @property
    def memory_bytes(self) -> float:
        """The step's peak (see the module docstring)."""
        return (
            self.runtime_bytes
            + self.weights_bytes
            + self.grads_bytes
            + self.optimizer_bytes
            + self.gathered_bytes
            + self.cache_bytes
            + self.activation_bytes
        )


@dataclass
class PartyLoad:
    """What one party holds and does per optimizer step (memory summed over
    its ranks; ``memory_bytes`` is its largest rank's peak)."""

    name: str
    params: int = 0
    layout: str = "one"  # ``LAYOUTS``: how its layers lie on its devices
    train_flops: float = 0.0  # per optimizer step
    weights_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activation_bytes: float = 0.0
    sent_bytes: float = 0.0  # per optimizer step, to the other party
    received_bytes: float = 0.0
    pieces: list[str] = field(default_factory=list)
    ranks: list[RankLoad] = field(default_factory=list)

    @property
    def memory_bytes(self) -> float:
        return max(r.memory_bytes for r in self.ranks)

    @property
    def largest_rank(self) -> RankLoad:
        return max(self.ranks, key=lambda r: r.memory_bytes)


@dataclass
class Plan:
    model: str
    config: ModelConfig
    partition: Partition
    workload: Workload
    parties: dict[str, PartySpec]
    loads: dict[str, PartyLoad]
    total_params: int

    def time_units(self, party: str) -> float:
        """Compute time per step in (FLOPs / throughput) units."""
        return self.loads[party].train_flops / self.parties[party].throughput

    @property
    def pipelined_time(self) -> float:
        """Ideal step time with both parties busy at once (compute only)."""
        return max(self.time_units(p) for p in PARTIES)

    @property
    def lockstep_time(self) -> float:
        return sum(self.time_units(p) for p in PARTIES)

    def to_dict(self) -> dict:
        total_flops = sum(ld.train_flops for ld in self.loads.values())
        return {
            "model": self.model,
            "cut": self.partition.spec,
            "layout": self.partition.describe(),
            "total_params": self.total_params,
            "workload": self.workload.__dict__,
            "parties": {
                name: {
                    "throughput": self.parties[name].throughput,
                    "devices": self.parties[name].devices,
                    "layout": ld.layout,
                    "memory_limit_bytes": self.parties[name].memory_bytes,
                    "params": ld.params,
                    "param_share": ld.params / self.total_params,
                    "train_flops_per_step": ld.train_flops,
                    "flops_share": ld.train_flops / total_flops,
                    "memory_bytes": {
                        "weights": ld.weights_bytes,
                        "grads": ld.grads_bytes,
                        "optimizer": ld.optimizer_bytes,
                        "activations": ld.activation_bytes,
                        "total": ld.memory_bytes,  # the largest rank's peak
                    },
                    "ranks": [
                        {
                            "rank": r.rank,
                            "pieces": _pieces(r),
                            "params": r.params,
                            "micro_batches_in_flight": r.in_flight,
                            "weights": r.weights_bytes,
                            "grads": r.grads_bytes,
                            "optimizer": r.optimizer_bytes,
                            "gathered": r.gathered_bytes,
                            "shard": list(r.shard) if r.shard else None,
                            "shard_params": r.shard_params,
                            "rows": r.rows,
                            "autocast_cache": r.cache_bytes,
                            "activations": r.activation_bytes,
                            "runtime": r.runtime_bytes,
                            "peak": r.memory_bytes,
                        }
                        for r in ld.ranks
                    ],
                    "bytes_sent_per_step": ld.sent_bytes,
                    "bytes_received_per_step": ld.received_bytes,
                    "pieces": ld.pieces,
                }
                for name, ld in self.loads.items()
            },
            "balance": {
                "time_A_over_B": self.time_units(DATA_PARTY)
                / self.time_units(COMPUTE_PARTY),
            },
        }

    def render(self) -> str:
        d = self.to_dict()
        w = self.workload
        lay = self.config.layout
        top = " (incl. top query)" if lay.head_layers else ""
        precision = "fp32 + bf16 autocast" if w.autocast else w.dtype
        extras = []
        if w.activation_checkpointing:
            extras.append("activation checkpointing")
        if any(self.loads[p].layout == "pipeline" for p in PARTIES):
            extras.append(f"{w.schedule} schedule over each party's devices")
        lines = [
            f"model {self.model}: {self.total_params:,} parameters, "
            f"{lay.num_layers} layers{top}, hidden {self.config.hidden_size}, "
            f"vocab {self.config.vocab_size}",
            f"workload: batch {w.batch_size} = {w.micro_batches} x micro-batch "
            f"{w.micro_batch_size}, seq {self.seq_len}, {precision}, link codec "
            f"{w.codec}, {w.in_flight} micro-batch(es) in flight on a one-device "
            "party" + "".join(f", {e}" for e in extras),
            f"cut: --cut {self.partition.spec}   ({self.partition.describe()})",
            "",
            f"{'party':<6}{'throughput':>11}{'params':>16}{'param %':>9}"
            f"{'FLOPs %':>9}{'weights':>12}{'grads':>12}{'optimizer':>12}"
            f"{'activations':>13}{'total mem':>12}{'limit':>15}",
        ]
        for name in PARTIES:
            p, ld = d["parties"][name], self.loads[name]
            lines.append(
                f"{name:<6}{p['throughput']:>11g}{ld.params:>16,}"
                f"{100 * p['param_share']:>8.1f}%{100 * p['flops_share']:>8.1f}%"
                f"{format_bytes(ld.weights_bytes):>12}"
                f"{format_bytes(ld.grads_bytes):>12}"
                f"{format_bytes(ld.optimizer_bytes):>12}"
                f"{format_bytes(ld.activation_bytes):>13}"
                f"{format_bytes(ld.memory_bytes):>12}"
                f"{self.parties[name].label:>15}"
            )
        for name in PARTIES:
            ld = self.loads[name]
            if len(ld.ranks) > 1:
                how = w.schedule
                if ld.layout == "sharded":
                    how = (
                        f"blocks FSDP2-sharded over {len(ld.ranks)} ranks, the "
                        "rest whole on each, each rank running its rows of every "
                        "micro-batch"
                    )
                lines += [
                    "",
                    f"{name} per rank ({how}; its total mem above is the "
                    "largest rank's, its limit each device's):",
                ]
                lines += [_group_line(g) for g in rank_groups(ld.ranks)]
        lines.append("")
        a, b = self.loads[DATA_PARTY], self.loads[COMPUTE_PARTY]
        lines.append(
            f"bytes crossing per optimizer step: A->B {format_bytes(a.sent_bytes)}, "
            f"B->A {format_bytes(b.sent_bytes)}"
        )
        ratio = self.pipelined_time / self.lockstep_time
        lines.append(
            f"compute time A/B = {d['balance']['time_A_over_B']:.2f}; ideal step "
            f"time pipelined / lockstep = {ratio:.2f}"
        )
        return "\n".join(lines)

    def misfits(self) -> list[str]:
        """Why each rank that does not fit its device does not, with the
        numbers (empty: every rank fits)."""
        out = []
        for name in PARTIES:
            limit = self.parties[name].memory_bytes
            for r in self.loads[name].ranks:
                if r.memory_bytes > limit:
                    out.append(
                        f"{name} rank {r.rank} ({_pieces(r)}) needs "
                        f"{format_bytes(r.memory_bytes)} at its peak "
                        f"({_breakdown(r)}), its device has {format_bytes(limit)}"
                    )
        return out

    @property
    def seq_len(self) -> int:
        return self.workload.seq_len or self.config.seq_len


def _pieces(r: RankLoad) -> str:
    """``embedding + h[0:3] + h[29:31] + top query``: consecutive blocks as
    one range."""
    runs: list[list[int]] = []
    for i in r.blocks:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    blocks = [f"h[{a}:{b}]" for a, b in runs]
    pieces = [r.head_pieces[0], *blocks, r.head_pieces[1]]
    if r.shard and blocks:  # the shard first, then what is whole
        k, ranks = r.shard
        pieces = [f"FSDP2 shard {k + 1}/{ranks} of {' '.join(blocks)}", *r.head_pieces]
    return " + ".join(p for p in pieces if p)


def _breakdown(r: RankLoad) -> str:
    parts = [
        f"weights {format_bytes(r.weights_bytes)}",
        f"grads {format_bytes(r.grads_bytes)}",
        f"optimizer {format_bytes(r.optimizer_bytes)}",
    ]
    if r.gathered_bytes:
        parts.append(f"gathered block {format_bytes(r.gathered_bytes)}")
    if r.cache_bytes:
        parts.append(f"autocast cache {format_bytes(r.cache_bytes)}")
    rows = f" of {r.rows} row(s)" if r.shard else ""
    parts.append(
        f"activations of {r.in_flight} micro-batch(es){rows} "
        f"{format_bytes(r.activation_bytes)}"
    )
    parts.append(f"runtime {format_bytes(r.runtime_bytes)}")
    return ", ".join(parts)


def _same_load(a: RankLoad, b: RankLoad) -> bool:
    """Whether rank ``b`` holds what rank ``a`` does, byte for byte: the same
    figures, the same whole pieces, and as many blocks (the same blocks'
    shards when sharded; the blocks right after ``a``'s when not, so that a
    group's blocks read as one range)."""
    figures = (
        "params",
        "shard_params",
        "in_flight",
        "rows",
        "weights_bytes",
        "grads_bytes",
        "optimizer_bytes",
        "cache_bytes",
        "activation_bytes",
        "runtime_bytes",
        "gathered_bytes",
    )
    if any(getattr(a, f) != getattr(b, f) for f in figures):
        return False
    if a.head_pieces != b.head_pieces or len(a.blocks) != len(b.blocks):
        return False
    if a.shard or b.shard:
        return (
            bool(a.shard and b.shard)
            and a.shard[1] == b.shard[1]
            and a.blocks == b.blocks
        )
    return not a.blocks or b.blocks[0] == a.blocks[-1] + 1


def rank_groups(ranks: list[RankLoad]) -> list[list[RankLoad]]:
    """Consecutive ranks that hold the same (``_same_load``), one group each:
    a 200B plan's 61 pipeline stages of one block each are one line, not 61."""
    groups: list[list[RankLoad]] = []
    for r in ranks:
        if groups and _same_load(groups[-1][-1], r):
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _group_line(group: list[RankLoad]) -> str:
    """One rank's line, or one line for a group of identical ranks
    (``ranks 0–15``): what each holds, and each one's peak."""
    first, last = group[0], group[-1]
    if len(group) == 1:
        label, pieces = f"rank {first.rank}", _pieces(first)
    else:
        label = f"ranks {first.rank}–{last.rank}"
        if first.shard:
            whole = _pieces(replace(first, shard=None, blocks=()))
            shards = _pieces(first).split(" + ")[0]  # FSDP2 shard k/R of ...
            of = shards.split(" of ", 1)[1]
            ranks = first.shard[1]
            pieces = (
                f"FSDP2 shards {first.shard[0] + 1}–{last.shard[0] + 1}/{ranks} "
                f"of {of}" + (f" + {whole}" if whole else "")
            )
        else:
            blocks = tuple(i for r in group for i in r.blocks)
            pieces = _pieces(replace(first, blocks=blocks))
            if first.blocks:
                n = len(first.blocks)
                pieces += f" ({n} block{'s' if n > 1 else ''} each)"
    return (
        f"  {label:<8} {pieces:<34}{first.params:>16,} params  peak "
        f"{format_bytes(first.memory_bytes):>11}  ({_breakdown(first)})"
    )


# --- per-piece arithmetic ------------------------------------------------------


def block_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Two FLOPs per matmul weight, plus attention's scores and weighted sum."""
    attention = cfg.num_heads * cfg.head_dim
    return 2.0 * cfg.block_matmul_weights + 4.0 * seq_len * attention


def head_forward_flops_per_token(cfg: ModelConfig) -> float:
    return 2.0 * cfg.hidden_size * cfg.vocab_size


def pipeline_stage_blocks(n_blocks: int, ranks: int) -> list[range]:
    """The contiguous blocks of each of ``ranks`` pipeline stages over
    ``n_blocks`` blocks: ``numpy.array_split``'s rule, the earlier stages
    taking the extra block (the planner's and the backbone pipeline's one
    rule). PlanError if a stage would get no block."""
    if ranks < 1:
        raise PlanError(f"{ranks} pipeline stages: need at least 1")
    if ranks > n_blocks:
        raise PlanError(
            f"{ranks} pipeline stages over {n_blocks} blocks: a stage would hold "
            f"no block; use at most {n_blocks} ranks"
        )
    base, extra = divmod(n_blocks, ranks)
    starts = [k * base + min(k, extra) for k in range(ranks + 1)]
    return [range(starts[k], starts[k + 1]) for k in range(ranks)]


def _exact_activations(cfg: ModelConfig) -> bool:
    """Whether ``block_activation_bytes`` counts this family's saved tensors
    exactly (PanGu-α's pre-LN block with exact GELU), not an upper estimate."""
    return cfg.layout.family == "pangu" and getattr(cfg, "activation", "") == "gelu"


def block_activation_bytes(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    *,
    autocast: bool = False,
) -> float:
    """Bytes autograd saves in one block's forward of ``micro_batch`` x
    ``seq_len`` tokens computed in ``dtype`` (``autocast``: bf16 autocast over
    fp32, ``dtype`` then fp32).

    PanGu-α: the inputs of ln_1 and ln_2, their outputs, q, k, v and the
    attention output (fused SDPA: with its log-sum-exp per head, no scores)
    are eight (B, T, h) tensors; the MLP's fc output and GELU output two
    (B, T, f); LayerNorm's mean and rstd two floats a token each. Under CPU
    bf16 autocast the LayerNorms' inputs and outputs stay fp32, the rest is
    bf16. Other families: Korthikanti et al. (2022), no recomputation.
    """
    tokens = micro_batch * seq_len
    h, a = cfg.hidden_size, cfg.num_heads
    if not _exact_activations(cfg):
        per_16bit = tokens * h * (34 + 5 * a * seq_len / h)
        return per_16bit * (2 if autocast else DTYPE_BYTES[dtype]) / 2
    f = cfg.ffn_size
    small = 4 * (4 + a)  # LayerNorm mean/rstd x 2, SDPA log-sum-exp per head
    if autocast:
        return tokens * (4 * 4 * h + 2 * (4 * h + 2 * f) + small)
    return tokens * (DTYPE_BYTES[dtype] * (8 * h + 2 * f) + small)


def block_input_bytes(
    cfg: ModelConfig, micro_batch: int, seq_len: int, dtype: str
) -> float:
    """What a checkpointed block keeps: its input, the residual stream (fp32
    under autocast)."""
    return micro_batch * seq_len * cfg.hidden_size * DTYPE_BYTES[dtype]


class ModuleSizes(dict):
    """``{module path: parameter count}``, and in ``shapes`` each module's
    parameters as ``(dim 0, numel)`` pairs: what FSDP2's dim-0 shards of it
    hold (``shard_params``)."""

    shapes: dict[str, tuple[tuple[int, int], ...]]

    def shard_count(self, path: str, rank: int, ranks: int) -> int:
        """``shard_params`` of ``path``, worked out once per rank: a plan
        weighs every rank of every cut, and a 200B model's cuts ask for the
        same few shards about a million times."""
        cache = self.__dict__.setdefault("_shard_counts", {})
        key = (path, rank, ranks)
        count = cache.get(key)
        if count is None:
            shapes = self.shapes.get(path, ((self[path], self[path]),))
            count = cache[key] = sum(
                dim0_chunk(d0, rank, ranks) * (numel // d0)
                for d0, numel in shapes
                if d0
            )
        return count


def module_sizes(model) -> ModuleSizes:
    """Parameter count (and shapes) of every submodule a partition names (a
    tied head is named by its embedding only, so it counts once)."""
    lay = model.config.layout
    blocks = (lay.block_path(i) for i in range(lay.num_blocks))
    paths = dict.fromkeys([*lay.embed, *blocks, *lay.head])
    out = ModuleSizes()
    out.shapes = {}
    for p in paths:
        params = list(model.get_submodule(p).parameters())
        out[p] = sum(x.numel() for x in params)
        out.shapes[p] = tuple((x.shape[0] if x.dim() else 1, x.numel()) for x in params)
    return out


def dim0_chunk(rows: int, rank: int, ranks: int) -> int:
    """Rows of dim 0 that rank ``rank`` of ``ranks`` keeps of a parameter of
    ``rows``: ``torch.chunk``'s k-th chunk, as FSDP2's ``Shard(0)`` cuts it
    (``ceil(rows / ranks)`` each, the last ranks fewer or none)."""
    size = -(-rows // ranks)
    return max(0, min(size, rows - rank * size))


def shard_params(sizes: dict[str, int], path: str, rank: int, ranks: int) -> int:
    """Parameters rank ``rank`` of ``ranks`` keeps of module ``path`` under
    FSDP2 (``dim0_chunk`` of each; from ``ModuleSizes.shapes``, or, for a
    plain dict of counts, of the module's count as one dim)."""
    if isinstance(sizes, ModuleSizes):
        return sizes.shard_count(path, rank, ranks)
    shapes = getattr(sizes, "shapes", {}).get(path, ((sizes[path], sizes[path]),))
    return sum(
        dim0_chunk(d0, rank, ranks) * (numel // d0) for d0, numel in shapes if d0
    )


def _per_block(
    sizes: dict[str, int], lay, shard: tuple[int, int] | None = None
) -> list[int]:
    """Each ordinary block's parameter count, or (``shard=(k, R)``) rank k's
    ``shard_params`` of it, indexed by block: kept with a ``ModuleSizes``
    (a plan weighs every rank of every cut, about a million block lookups at
    200B, so each is worked out once)."""
    cache = getattr(sizes, "__dict__", {})
    key = ("per_block", lay.block, lay.num_blocks, shard)
    counts = cache.get(key)
    if counts is None:
        paths = [lay.block_path(i) for i in range(lay.num_blocks)]
        if shard is None:
            counts = [sizes[p] for p in paths]
        else:
            counts = [shard_params(sizes, p, *shard) for p in paths]
        cache[key] = counts
    return counts


def rank_load(
    sizes: dict[str, int],
    cfg: ModelConfig,
    w: Workload,
    blocks: list[int],
    *,
    embed: bool,
    head: bool,
    rank: int = 0,
    in_flight: int | None = None,
    shard: tuple[int, int] | None = None,
    sharded_grads: bool = True,
) -> RankLoad:
    """The memory of one process holding ``blocks`` (and the embedding, the
    head) for one step of ``w``: a rank of a party, or (all blocks, embedding
    and head) the unsplit model.

    ``shard=(k, R)``: the blocks are FSDP2-sharded over R ranks and this is
    rank k (the module docstring's ``sharded`` layout): it keeps its dim-0
    chunks of the blocks' weights and AdamW state, one block's whole weights
    while gathered, its gradients sharded too (``sharded_grads``) or whole,
    and the activations of its rows of each micro-batch; the embedding and
    the head stay whole."""
    lay = cfg.layout
    T, mb = w.seq_len or cfg.seq_len, w.micro_batch_size
    dt, act_dt = DTYPE_BYTES[w.dtype], DTYPE_BYTES[w.act_dtype]
    block_sizes = _per_block(sizes, lay)
    ends: list[str] = []
    r = RankLoad(rank, tuple(blocks), shard=shard)
    if embed:
        ends += list(lay.embed)
        r.head_pieces[0] = "embedding"
    if head:
        ends += list(lay.head)
        r.head_pieces[1] = lay.head_label
    if shard is None:
        block_paths = [lay.block_path(i) for i in blocks]
        r.params = sum(sizes[p] for p in dict.fromkeys(block_paths + ends))
        grads = r.params
    else:
        k, ranks = shard
        mb = mb // ranks + (k < mb % ranks)  # tensor_split's rows: ceil first
        whole = sum(sizes[p] for p in dict.fromkeys(ends))
        shards = _per_block(sizes, lay, shard)
        r.shard_params = sum(shards[i] for i in blocks)
        r.params = whole + r.shard_params
        full = sum(block_sizes[i] for i in blocks)
        grads = r.params if sharded_grads else whole + full
        largest = max((block_sizes[i] for i in blocks), default=0)
        r.gathered_bytes = largest * dt
    r.rows = mb
    r.in_flight = w.in_flight if in_flight is None else in_flight
    r.weights_bytes = r.params * dt
    r.grads_bytes = grads * dt
    r.optimizer_bytes = r.params * (8 + (0 if w.dtype == "fp32" else 4))
    r.runtime_bytes = w.runtime_bytes
    n_layers = len(blocks) + (lay.head_layers if head else 0)
    block = block_activation_bytes(cfg, mb, T, w.dtype, autocast=w.autocast)
    if w.autocast:
        # autocast's bf16 copy of each matrix a block (or the head) uses
        matrices = n_layers * cfg.block_matmul_weights
        if head:
            matrices += cfg.vocab_size * cfg.hidden_size
        r.cache_bytes = 2.0 * matrices
    if w.activation_checkpointing:
        per_micro = n_layers * block_input_bytes(cfg, mb, T, w.dtype)
        once = block if n_layers else 0.0  # the block being recomputed
    else:
        per_micro, once = n_layers * block, 0.0
    if head:
        # the final LayerNorm's input and the top layer's query, then the
        # logits in the compute dtype and log-softmax's fp32 output
        per_micro += 2 * mb * T * cfg.hidden_size * act_dt
        per_micro += mb * T * cfg.vocab_size * (act_dt + 4)
    if embed:
        per_micro += mb * T * 16  # the token and position ids (int64)
    r.activation_bytes = per_micro * r.in_flight + once
    return r


def _in_flight(w: Workload, rank: int, ranks: int) -> int:
    """Micro-batches whose activations stage ``rank`` of ``ranks`` holds."""
    if ranks == 1 or w.schedule == "window":
        return w.in_flight  # the link's pipelining window
    m = w.micro_batches
    return m if w.schedule == "gpipe" else min(m, ranks - rank)


def party_layout(party: str, layers: int, devices: int) -> str:
    """How a party with ``layers`` layers (its ordinary blocks, and PanGu-α's
    top query layer where it holds the head) lies on ``devices`` devices, as
    its torchrun job runs it (``LAYOUTS``; the module docstring): the data
    party is sharded on more than one, the compute party pipelined up to one
    device per layer and sharded beyond."""
    if devices < 1:
        raise PlanError(f"{devices} devices: need at least 1")
    if devices == 1:
        return "one"
    if party == DATA_PARTY or devices > layers:
        return "sharded"
    return "pipeline"


def party_load(
    sizes: dict[str, int],
    cfg: ModelConfig,
    partition: Partition,
    party: str,
    workload: Workload,
    devices: int = 1,
    *,
    peak_only: bool = False,
) -> PartyLoad:
    """Parameters, FLOPs, memory (per rank, in the layout ``party_layout``
    gives ``devices``) and traffic of one party for one step. PlanError if
    the layout cannot run the workload (sharded ranks with fewer rows in a
    micro-batch than ranks). ``peak_only``: only the ranks that can hold the
    peak (the first and the last: the first holds the most rows and chunks,
    the most blocks and micro-batches of a pipeline, and the embedding; the
    last the head), so ``memory_bytes`` is right; its sums, parameters and
    FLOPs are not worked out."""
    w, T = workload, workload.seq_len or cfg.seq_len
    lay = cfg.layout
    tokens = w.batch_size * T
    ld = PartyLoad(party)
    stages: list[Stage] = list(partition.stages_of(party))
    fwd_per_token = 0.0
    for stage in [] if peak_only else stages:
        ld.pieces.append(stage.describe(lay))
        n_blocks = len(stage.blocks) + (lay.head_layers if stage.head else 0)
        fwd_per_token += n_blocks * block_forward_flops_per_token(cfg, T)
        if stage.head:
            fwd_per_token += head_forward_flops_per_token(cfg)
    ld.train_flops = 3.0 * fwd_per_token * tokens
    if not peak_only:
        ld.params = sum(sizes[p] for p in partition.module_paths(party))
    # The party's layers in forward order (the head's own, PanGu-α's top
    # query layer, last). Pipelined, they are spread over its ranks; the
    # embedding goes to the first rank, the rest of the head to the last (a
    # tied head's embedding is then held by both, as Megatron-LM keeps it).
    # Sharded, every rank holds a shard of each block and the rest whole.
    embed = any(st.embed for st in stages)
    head = any(st.head for st in stages)
    layers = [i for st in stages for i in st.blocks]
    layers += [lay.num_blocks + j for j in range(lay.head_layers if head else 0)]
    ld.layout = party_layout(party, len(layers), devices)
    ranks = sorted({0, devices - 1}) if peak_only else range(devices)
    if ld.layout == "sharded":
        _shard_ranks(ld, sizes, cfg, w, layers, devices, ranks, embed=embed, head=head)
    else:
        _stage_ranks(ld, sizes, cfg, w, layers, devices, ranks, embed=embed, head=head)
    for name in ("weights_bytes", "grads_bytes", "optimizer_bytes"):
        setattr(ld, name, sum(getattr(r, name) for r in ld.ranks))
    ld.activation_bytes = sum(r.activation_bytes for r in ld.ranks)
    ld.sent_bytes, ld.received_bytes = _traffic(cfg, partition, party, w, T)
    return ld


def _stage_ranks(
    ld: PartyLoad,
    sizes: dict[str, int],
    cfg: ModelConfig,
    w: Workload,
    layers: list[int],
    devices: int,
    ranks: range | list[int],
    *,
    embed: bool,
    head: bool,
) -> None:
    """The ranks of a party on one device, or pipelined over ``devices``."""
    spread = pipeline_stage_blocks(len(layers), devices) if devices > 1 else None
    n_blocks = cfg.layout.num_blocks
    for k in ranks:
        idx = [layers[i] for i in spread[k]] if spread else layers
        first, last = k == 0, k == devices - 1
        ld.ranks.append(
            rank_load(
                sizes,
                cfg,
                w,
                [i for i in idx if i < n_blocks],
                embed=embed and first,
                head=head and last,
                rank=k,
                in_flight=_in_flight(w, k, devices),
            )
        )


def _shard_ranks(
    ld: PartyLoad,
    sizes: dict[str, int],
    cfg: ModelConfig,
    w: Workload,
    layers: list[int],
    devices: int,
    ranks: range | list[int],
    *,
    embed: bool,
    head: bool,
) -> None:
    """The ranks of a party whose blocks are FSDP2-sharded over ``devices``."""
    if w.micro_batch_size < devices:
        who = "data party" if ld.name == DATA_PARTY else "compute party"
        more = f"; or give B at most {len(layers)} devices (pipeline stages)"
        raise PlanError(
            f"the {who} on {devices} devices shards its blocks (FSDP2) and "
            f"shares each micro-batch's rows over them: micro-batches of "
            f"{w.micro_batch_size} row(s) would leave ranks idle; use a "
            f"micro-batch size of at least {devices}"
            + (more if ld.name == COMPUTE_PARTY else "")
        )
    n_blocks = cfg.layout.num_blocks
    blocks = [i for i in layers if i < n_blocks]
    for k in ranks:
        ld.ranks.append(
            rank_load(
                sizes,
                cfg,
                w,
                blocks,
                embed=embed,
                head=head,
                rank=k,
                in_flight=w.in_flight,  # every rank runs the link's window
                shard=(k, devices),
                # A reduce-scatters every backward; B once, in the last
                sharded_grads=ld.name == DATA_PARTY,
            )
        )


def _traffic(
    cfg: ModelConfig, partition: Partition, party: str, w: Workload, T: int
) -> tuple[float, float]:
    """(sent, received) bytes per optimizer step for ``party``, payload only."""
    cut = w.batch_size * T * cfg.hidden_size * w.wire_bytes_per_value
    # Each cut crossing carries an activation one way and its gradient back.
    # U-shape: A->B act(front) + grad(out of B); B->A out(B) + grad(input of B).
    a_to_b = 2 * cut
    b_to_a = 2 * cut
    if w.eod_reset:
        a_to_b += w.batch_size * T * 4  # int32 document index per position
    if not partition.is_u_shape:
        # Two-way: one crossing each way (act A->B, its gradient B->A), the
        # labels (int64) to B, and both halves of the tied embedding's gradient.
        tied = cfg.vocab_size * cfg.hidden_size * DTYPE_BYTES[w.dtype]
        a_to_b = cut + w.batch_size * T * 8 + tied
        b_to_a = cut + tied
        if w.eod_reset:
            a_to_b += w.batch_size * T * 4
    return (a_to_b, b_to_a) if party == DATA_PARTY else (b_to_a, a_to_b)


def evaluate(
    model_name: str,
    cfg: ModelConfig,
    partition: Partition,
    parties: dict[str, PartySpec],
    workload: Workload,
    sizes: dict[str, int] | None = None,
) -> Plan:
    """The :class:`Plan` of a given cut (``sizes``: ``module_sizes`` of the model,
    to skip rebuilding it on meta)."""
    sizes = sizes or module_sizes(build_model(cfg, device="meta"))
    loads = {
        p: party_load(sizes, cfg, partition, p, workload, parties[p].devices)
        for p in PARTIES
    }
    total = sum(sizes.values())
    return Plan(model_name, cfg, partition, workload, parties, loads, total)


#: Blocks the data party keeps on each side of B by default. With none before
#: the cut, A sends the raw token embeddings, which anyone who knows the
#: embedding inverts by nearest-neighbour lookup; with none after it, B's
#: output is one LayerNorm and the top query layer away from the logits.
MIN_A_BLOCKS = 1


def exposure_warning(partition: Partition) -> str | None:
    """Why a cut with no block on a side of A gives A's data away, if it does."""
    sides = []
    if partition.front == 0:
        sides.append(
            "no block before the front cut: A sends the raw token embeddings, "
            "which the compute party inverts to the tokens by nearest-neighbour "
            "lookup in the embedding"
        )
    if partition.is_u_shape and partition.back == 0:
        sides.append(
            "no block after the back cut: what B returns is one LayerNorm and the "
            "top query layer away from the logits, so its gradient gives the "
            "labels away"
        )
    if not sides:
        return None
    return f"cut {partition.spec} keeps " + "; and ".join(sides)


def candidates(cfg: ModelConfig, shape: str, min_a_blocks: int) -> list[Partition]:
    """Every cut of ``shape`` with at least ``min_a_blocks`` blocks of A on each
    side of B (before the cut only, for a two-way cut)."""
    n = cfg.num_blocks
    k0 = min_a_blocks
    if shape == "u":
        return [
            Partition(cfg.layout, f, k) for f in range(k0, n) for k in range(k0, n - f)
        ]
    if shape == "two-way":
        return [Partition(cfg.layout, f, None) for f in range(k0, n)]
    raise PlanError(f"shape {shape!r}: use 'u' or 'two-way'")


#: a plan that takes longer than this logs how far it is, then again every
#: ``PROGRESS_EVERY_S`` (200B's 1 891 cuts take about 2 s on a quiet box)
PROGRESS_AFTER_S = 3.0
PROGRESS_EVERY_S = 5.0


def plan(
    model_name: str,
    cfg: ModelConfig,
    parties: list[PartySpec],
    workload: Workload,
    *,
    shape: str = "u",
    min_a_blocks: int = MIN_A_BLOCKS,
) -> Plan:
    """The cut that balances compute time (FLOPs / throughput) within memory.

    Minimises the slower party's compute time per step (the step time when the
    parties pipeline); ties go to fewer blocks on A. A keeps at least
    ``min_a_blocks`` blocks on each side of B (a privacy constraint: see
    ``MIN_A_BLOCKS``). Raises PlanError if no cut fits both memory limits.
    """
    by_name = {p.name: p for p in parties}
    if sorted(by_name) != sorted(PARTIES) or len(parties) != 2:
        raise PlanError("give exactly one --party A:... and one --party B:...")
    if workload.seq_len and workload.seq_len > cfg.seq_len:
        raise PlanError(f"seq_len {workload.seq_len} exceeds the model's {cfg.seq_len}")
    sides = 2 if shape == "u" else 1
    if min_a_blocks < 0 or sides * min_a_blocks >= cfg.num_blocks:
        raise PlanError(
            f"--min-a-blocks {min_a_blocks}: the model has {cfg.num_blocks} "
            f"ordinary blocks; A would take {sides * min_a_blocks} and B needs at "
            "least one"
        )
    sizes = module_sizes(build_model(cfg, device="meta"))
    best: tuple[tuple[float, int], Plan] | None = None
    needs: list[tuple[Partition, dict[str, float], tuple]] = []  # each cut's
    usable = None
    cuts = candidates(cfg, shape, min_a_blocks)
    started = time.monotonic()
    next_word = started + PROGRESS_AFTER_S
    for n, part in enumerate(cuts):
        if time.monotonic() >= next_word:  # a slow box: say it is working
            log.info(
                "planning %s: weighed %d of %d %s cuts (%.0f s)",
                model_name,
                n,
                len(cuts),
                shape,
                time.monotonic() - started,
            )
            next_word += PROGRESS_EVERY_S
        try:
            pl = evaluate(model_name, cfg, part, by_name, workload, sizes)
        except PlanError as e:  # more devices than this cut gives a party blocks
            usable = usable or e
            continue
        a_blocks = part.front + (part.back or 0)
        key = (float(f"{pl.pipelined_time:.12g}"), a_blocks)
        needs.append((part, {p: pl.loads[p].memory_bytes for p in PARTIES}, key))
        if any(pl.loads[p].memory_bytes > by_name[p].memory_bytes for p in PARTIES):
            continue
        if best is None or key < best[0]:
            best = (key, pl)
    if best is None and not needs:
        raise PlanError(f"no {shape} cut of {model_name} can use the devices: {usable}")
    if best is None:
        from aisyn.model.plan_fit import balanced_cut, fewest_devices, no_fit_message

        fit = fewest_devices(sizes, cfg, cuts, by_name, workload)
        closest = balanced_cut(needs)
        raise PlanError(
            no_fit_message(model_name, shape, closest, by_name, workload, fit)
        )
    return best[1]

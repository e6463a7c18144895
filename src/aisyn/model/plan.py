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

Training is 3x forward (backward = 2x forward). Memory per party is weights +
gradients (parameter dtype) + AdamW moments (2 x fp32, plus an fp32 master copy
when parameters are 16-bit) + activations of the micro-batches in flight, with
the per-block activation estimate of Korthikanti et al. (2022) without
recomputation, ``bT h (34 + 5aT/h)`` bytes at 16 bits (scaled for fp32), and
the head's logits. It is an upper estimate: fused attention kernels never
store the ``aT²`` scores.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from aisyn.model.families import ModelConfig, build_model
from aisyn.model.segments import (
    COMPUTE_PARTY,
    DATA_PARTY,
    PARTIES,
    Partition,
    Stage,
)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
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
    """A party's relative throughput (any unit, the same for both) and memory."""

    name: str
    throughput: float
    memory_bytes: float

    @classmethod
    def parse(cls, text: str) -> PartySpec:
        parts = text.split(":")
        if len(parts) != 3:
            raise PlanError(
                f"--party {text!r}: expected NAME:THROUGHPUT:MEMORY, e.g. A:1:32GB"
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
        return cls(name, throughput, parse_bytes(mem))


@dataclass(frozen=True)
class Workload:
    batch_size: int = 8  # samples per optimizer step
    micro_batch_size: int = 1
    seq_len: int | None = None  # None: the model's
    dtype: str = "fp32"  # parameters, gradients and activations
    codec: str = "none"  # cut-layer compression on the link
    in_flight: int = 1  # micro-batches whose activations a party holds at once
    eod_reset: bool = False

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

    @property
    def micro_batches(self) -> int:
        return self.batch_size // self.micro_batch_size

    @property
    def wire_bytes_per_value(self) -> float:
        return CODEC_BYTES[self.codec] or float(DTYPE_BYTES[self.dtype])


@dataclass
class PartyLoad:
    """What one party holds and does per optimizer step."""

    name: str
    params: int = 0
    train_flops: float = 0.0  # per optimizer step
    weights_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activation_bytes: float = 0.0
    sent_bytes: float = 0.0  # per optimizer step, to the other party
    received_bytes: float = 0.0
    pieces: list[str] = field(default_factory=list)

    @property
    def memory_bytes(self) -> float:
        return (
            self.weights_bytes
            + self.grads_bytes
            + self.optimizer_bytes
            + self.activation_bytes
        )


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
                        "total": ld.memory_bytes,
                    },
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
        lines = [
            f"model {self.model}: {self.total_params:,} parameters, "
            f"{lay.num_layers} layers{top}, hidden {self.config.hidden_size}",
            f"workload: batch {w.batch_size} = {w.micro_batches} x micro-batch "
            f"{w.micro_batch_size}, seq {self.seq_len}, {w.dtype}, link codec "
            f"{w.codec}, {w.in_flight} micro-batch(es) in flight",
            f"cut: --cut {self.partition.spec}   ({self.partition.describe()})",
            "",
            f"{'party':<6}{'throughput':>11}{'params':>16}{'param %':>9}"
            f"{'FLOPs %':>9}{'weights':>12}{'grads':>12}{'optimizer':>12}"
            f"{'activations':>13}{'total mem':>12}{'limit':>12}",
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
                f"{format_bytes(self.parties[name].memory_bytes):>12}"
            )
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

    @property
    def seq_len(self) -> int:
        return self.workload.seq_len or self.config.seq_len


# --- per-piece arithmetic ------------------------------------------------------


def block_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Two FLOPs per matmul weight, plus attention's scores and weighted sum."""
    attention = cfg.num_heads * cfg.head_dim
    return 2.0 * cfg.block_matmul_weights + 4.0 * seq_len * attention


def head_forward_flops_per_token(cfg: ModelConfig) -> float:
    return 2.0 * cfg.hidden_size * cfg.vocab_size


def block_activation_bytes(
    cfg: ModelConfig, micro_batch: int, seq_len: int, dtype: str
) -> float:
    """Korthikanti et al. (2022), no recomputation, scaled to ``dtype``."""
    h, a = cfg.hidden_size, cfg.num_heads
    per_16bit = seq_len * micro_batch * h * (34 + 5 * a * seq_len / h)
    return per_16bit * DTYPE_BYTES[dtype] / 2


def module_sizes(model) -> dict[str, int]:
    """Parameter count of every submodule a partition names (a tied head is
    named by its embedding only, so it counts once)."""
    lay = model.config.layout
    blocks = (lay.block_path(i) for i in range(lay.num_blocks))
    paths = dict.fromkeys([*lay.embed, *blocks, *lay.head])
    return {
        p: sum(x.numel() for x in model.get_submodule(p).parameters()) for p in paths
    }


def party_load(
    sizes: dict[str, int],
    cfg: ModelConfig,
    partition: Partition,
    party: str,
    workload: Workload,
) -> PartyLoad:
    """Parameters, FLOPs, memory and traffic of one party for one step."""
    w, T = workload, workload.seq_len or cfg.seq_len
    tokens = w.batch_size * T
    ld = PartyLoad(party)
    ld.params = sum(sizes[p] for p in partition.module_paths(party))
    fwd_per_token = 0.0
    act = 0.0
    stages: list[Stage] = list(partition.stages_of(party))
    dt = DTYPE_BYTES[w.dtype]
    for stage in stages:
        ld.pieces.append(stage.describe(cfg.layout))
        n_blocks = len(stage.blocks) + (cfg.layout.head_layers if stage.head else 0)
        fwd_per_token += n_blocks * block_forward_flops_per_token(cfg, T)
        act += n_blocks * block_activation_bytes(cfg, w.micro_batch_size, T, w.dtype)
        if stage.head:
            fwd_per_token += head_forward_flops_per_token(cfg)
            # logits in the parameter dtype plus the fp32 copy the loss makes
            act += w.micro_batch_size * T * cfg.vocab_size * (dt + 4)
        if stage.embed:
            act += w.micro_batch_size * T * cfg.hidden_size * dt
    ld.train_flops = 3.0 * fwd_per_token * tokens
    ld.weights_bytes = ld.params * dt
    ld.grads_bytes = ld.params * dt
    master = 0 if w.dtype == "fp32" else 4
    ld.optimizer_bytes = ld.params * (8 + master)
    ld.activation_bytes = act * w.in_flight
    ld.sent_bytes, ld.received_bytes = _traffic(cfg, partition, party, w, T)
    return ld


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
    loads = {p: party_load(sizes, cfg, partition, p, workload) for p in PARTIES}
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
    smallest: dict[str, float] = {p: math.inf for p in PARTIES}
    for part in candidates(cfg, shape, min_a_blocks):
        pl = evaluate(model_name, cfg, part, by_name, workload, sizes)
        for p in PARTIES:
            smallest[p] = min(smallest[p], pl.loads[p].memory_bytes)
        if any(pl.loads[p].memory_bytes > by_name[p].memory_bytes for p in PARTIES):
            continue
        a_blocks = part.front + (part.back or 0)
        key = (float(f"{pl.pipelined_time:.12g}"), a_blocks)
        if best is None or key < best[0]:
            best = (key, pl)
    if best is None:
        need = ", ".join(
            f"{p} needs at least {format_bytes(smallest[p])}" for p in PARTIES
        )
        raise PlanError(
            f"no {shape} cut of {model_name} fits the parties' memory ({need}); add "
            "memory, lower --micro-batch-size/--seq-len, or use bf16"
        )
    return best[1]

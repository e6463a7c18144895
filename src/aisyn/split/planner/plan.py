"""The planner's input and output: each party's throughput and devices
(``PartySpec``), and the weighed cut (``Plan``) with its table."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from aisyn.model.cost import PlanError, format_bytes, parse_bytes
from aisyn.model.families import ModelConfig
from aisyn.model.memory import PartyLoad, RankLoad, Workload
from aisyn.model.segments import COMPUTE_PARTY, DATA_PARTY, PARTIES, Partition


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
                            "pieces": r.describe(),
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
                        f"{name} rank {r.rank} ({r.describe()}) needs "
                        f"{format_bytes(r.memory_bytes)} at its peak "
                        f"({_breakdown(r)}), its device has {format_bytes(limit)}"
                    )
        return out

    @property
    def seq_len(self) -> int:
        return self.workload.seq_len or self.config.seq_len


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
        label, pieces = f"rank {first.rank}", first.describe()
    else:
        label = f"ranks {first.rank}–{last.rank}"
        if first.shard:
            whole = replace(first, shard=None, blocks=()).describe()
            shards = first.describe().split(" + ")[0]  # FSDP2 shard k/R of ...
            of = shards.split(" of ", 1)[1]
            ranks = first.shard[1]
            pieces = (
                f"FSDP2 shards {first.shard[0] + 1}–{last.shard[0] + 1}/{ranks} "
                f"of {of}" + (f" + {whole}" if whole else "")
            )
        else:
            blocks = tuple(i for r in group for i in r.blocks)
            pieces = replace(first, blocks=blocks).describe()
            if first.blocks:
                n = len(first.blocks)
                pieces += f" ({n} block{'s' if n > 1 else ''} each)"
    return (
        f"  {label:<8} {pieces:<34}{first.params:>16,} params  peak "
        f"{format_bytes(first.memory_bytes):>11}  ({_breakdown(first)})"
    )


# --- per-piece arithmetic ------------------------------------------------------

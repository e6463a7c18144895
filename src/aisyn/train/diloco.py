"""Cross-centre training a wide-area link can carry: DiLoCo.

Data-parallel training all-reduces every step's gradients, and across
centres joined by a wide-area link that all-reduce is the whole cost (a 2.6B
model's fp32 gradients are 10.4 GB a step). DiLoCo (Douillard et al., 2023)
synchronises rarely: each centre takes ``inner_steps`` (H) steps of its own
optimizer on its own data, then the centres average their *pseudo-gradients*
(the global model minus their local one), an outer optimizer -- SGD with
Nesterov momentum, OpenDiLoCo's lr 0.7 and momentum 0.9 -- steps the global
model, and every centre goes on from it. One exchange every H steps instead
of H, optionally in bf16 / fp16, or int8 with a scale per block of the flat
delta (INTELLECT-1's choice): 2x or 4x fewer bytes again.

The exchange is ``torch.distributed`` (gloo on CPU, NCCL on GPU) on the
centres' process group: an all-reduce of fp32 deltas, or an all-gather of the
compressed ones that every centre decodes and averages in the same order, so
all centres compute the same global model to the bit. torchft's DiLoCo was
considered and not used (docs/cross_centre.md says why).

``DiLoCoExecutor`` wraps a centre's local executor from outside: the model
and the local executor know nothing of it. An outer step whose averaged delta
is not finite is skipped on every centre (each returns to the last global
model), and ``max_skipped`` such steps in a row stop the run with one line. A
centre whose own delta is out of bound (``train.delta_guard``: its norm
against the others' and its own history, its direction against the run's) is
left out of the mean by name, and ``max_skipped`` such steps in a row stop
the run naming it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from aisyn.errors import RunFailedError
from aisyn.link.codec import decode_flat, encode_flat, flat_sizes
from aisyn.train import checkpoint as ckpt
from aisyn.train import fsdp
from aisyn.train.config import TrainConfig, per_rank_micro_batches
from aisyn.train.delta_guard import (
    TOLERANCE,
    DeltaGuard,
    Verdict,
    consistent,
    screen_stats,
)
from aisyn.train.distributed import DistContext
from aisyn.train.objective import StepBatch
from aisyn.train.regime import Executor
from aisyn.train.run import RunDir
from aisyn.validate import check_resumable, holds_run, number_problem

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16", "int8")
#: elements per int8 scale of the flat delta (a scale per tensor would let
#: one large tensor's range crush a small one's)
INT8_BLOCK = 4096
#: the outer optimizer's state in a checkpoint
OUTER_FILE = "outer.safetensors"
#: the data each centre reads: ``split``: every centre the same data, each
#: its own share of every global batch (DDP's rows); ``own``: centre i reads
#: the i-th data folder alone (a domain each)
DATA_MODES = ("split", "own")


class OuterStepError(FloatingPointError):
    """Outer steps were skipped for non-finite deltas too many times in a row."""


@dataclass(frozen=True)
class DiLoCoConfig:
    inner_steps: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    precision: str = "fp32"
    data: str = "split"
    max_skipped: int = 3
    #: torchrun's ranks per centre: DDP inside a centre, the outer step
    #: across centres (each of a centre's ranks exchanging its own share)
    ranks_per_centre: int = 1
    #: Streaming DiLoCo: the model in ``fragments`` of about equal size, each
    #: exchanged every H steps, H / fragments steps after the one before it
    fragments: int = 1
    #: inner steps an exchange overlaps (< H / fragments): started that many
    #: steps before the fragment's outer step, it crosses while the centre
    #: trains on; the fragment is then ``mixing`` x local + the rest global
    overlap_steps: int = 0
    mixing: float = 0.5
    #: a centre's delta whose norm is above this many times the other
    #: centres' median (or its own last accepted one) is left out (delta_guard)
    delta_bound: float = 4.0
    #: ... and one whose cosine to the run's recent direction is below this
    delta_min_cosine: float = -0.5

    def __post_init__(self) -> None:
        checks = {
            "inner_steps": dict(low=1),
            "ranks_per_centre": dict(low=1),
            "fragments": dict(low=1),
            "overlap_steps": dict(low=0),
            "mixing": dict(low=0, high=1, high_open=True),
            "outer_lr": dict(low=0, low_open=True),
            "outer_momentum": dict(low=0, high=1, high_open=True),
            "max_skipped": dict(low=1),
            "delta_bound": dict(low=1, low_open=True),
            "delta_min_cosine": dict(low=-1, high=1),
        }
        for name, bounds in checks.items():
            value = getattr(self, name)
            integer = name not in (
                "outer_lr",
                "outer_momentum",
                "mixing",
                "delta_bound",
                "delta_min_cosine",
            )
            if integer and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"--{_flag(name)} must be an integer, got {value!r}")
            if problem := number_problem(value, **bounds):
                raise ValueError(f"--{_flag(name)} {problem}")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"--delta-precision {self.precision!r}: one of {', '.join(PRECISIONS)}"
            )
        if self.data not in DATA_MODES:
            raise ValueError(f"--centre-data {self.data!r}: one of {DATA_MODES}")
        if self.inner_steps % self.fragments:
            raise ValueError(
                f"--inner-steps {self.inner_steps} does not split into --fragments "
                f"{self.fragments}: a fragment's exchange every H / fragments steps"
            )
        if self.overlap_steps >= self.inner_steps // self.fragments:
            raise ValueError(
                f"--overlap-steps {self.overlap_steps} must be below --inner-steps / "
                f"--fragments ({self.inner_steps // self.fragments}): an exchange "
                "ends before the next fragment's begins"
            )

    @property
    def slot(self) -> int:
        """Steps between one fragment's outer step and the next one's."""
        return self.inner_steps // self.fragments

    def due(self, done: int, fragment: int, lead: int = 0) -> bool:
        """Whether, after ``done`` steps, ``fragment``'s outer step is due
        (``lead`` steps early: its exchange starts). The last fragment's is
        due after every H steps, where the checkpoints are: nothing is under
        way there."""
        h = self.inner_steps
        return done % h == ((fragment + 1) * self.slot - lead) % h

    @property
    def merge(self) -> float:
        """The local share of a fragment after an overlapped exchange."""
        return self.mixing if self.overlap_steps else 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _flag(name: str) -> str:
    special = {"precision": "delta-precision", "mixing": "overlap-mixing"}
    return special.get(name, name.replace("_", "-"))


# --- the delta on the wire ---------------------------------------------------------


#: DiLoCo's precisions as the link's codecs (``link/codec.py``: one codec)
_CODEC = {"fp32": "none", "bf16": "bf16", "fp16": "fp16", "int8": "int8"}


def encode(delta: torch.Tensor, precision: str) -> list[torch.Tensor]:
    """The flat fp32 ``delta`` as what crosses: itself, or the link codec's
    bytes of it -- a half-precision copy, or int8 codes with one fp32 scale
    per ``INT8_BLOCK`` (absmax / 127; a block with a non-finite value decodes
    to NaN, so the receiver sees it)."""
    if precision == "fp32":
        return [delta]
    side, payload = encode_flat(delta, _CODEC[precision], block=INT8_BLOCK)
    return [payload, side] if side.numel() else [payload]


def decode(payload: list[torch.Tensor], precision: str, numel: int) -> torch.Tensor:
    """``encode``'s inverse (up to its rounding), as flat fp32."""
    if precision == "fp32":
        return payload[0].to(torch.float32)
    side = payload[1] if len(payload) > 1 else torch.empty(0, dtype=torch.uint8)
    return decode_flat(side, payload[0], _CODEC[precision], numel, block=INT8_BLOCK)


def payload_bytes(payload: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


def encoded_bytes(numel: int, precision: str) -> int:
    """``payload_bytes(encode(delta, precision))`` for ``numel`` values,
    without encoding them."""
    return sum(flat_sizes(_CODEC[precision], numel, block=INT8_BLOCK))


def ring_bytes_sent(nbytes: int, centres: int, op: str) -> int:
    """What one centre sends for a ring collective over ``centres`` of a
    payload of ``nbytes`` (its own share): all-reduce 2 (N-1)/N of it,
    all-gather (N-1)/N of everyone's."""
    if centres <= 1:
        return 0
    if op == "all_reduce":
        return round(2 * (centres - 1) / centres * nbytes)
    return (centres - 1) * nbytes


# --- centres of ranks ------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    """Where a rank stands in a job of centres of ``inner.world`` ranks each
    (the ranks of a centre contiguous, as torchrun numbers a node's).

    ``job``: the whole job; ``inner``: this centre's ranks, DDP's group;
    ``across``: the rank with this one's place in every centre, the group its
    share of the outer exchange crosses the wide-area link in.
    """

    job: DistContext
    inner: DistContext
    across: DistContext

    @property
    def centre(self) -> int:
        return self.across.rank

    @property
    def centres(self) -> int:
        return self.across.world

    def name(self, rank: int) -> str:
        """How a message names job rank ``rank``: its centre (and its rank)."""
        return centre_label(rank, self.inner.world)


def centre_label(rank: int, ranks_per_centre: int) -> str:
    """Job rank ``rank``'s centre (and, in a centre of several, its rank)."""
    per = ranks_per_centre
    return f"centre {rank // per}" + (f" (rank {rank})" if per > 1 else "")


def label_logs(label: str) -> Callable[[], None]:
    """Prefix every log line this process writes with ``label`` (its
    centre): the centres of a job on one machine log to one terminal, in
    either order. Returns what takes the prefix off again."""

    class Label(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if getattr(record, "centre", None) is None:  # once, however many handlers
                record.centre = label
                record.msg = f"{label}: {record.msg}"
            return True

    label_filter = Label()
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(label_filter)

    def remove() -> None:
        for handler in handlers:
            handler.removeFilter(label_filter)

    return remove


def centre_of(rank: int, world: int, ranks_per_centre: int) -> tuple[int, int]:
    """(centre, number of centres) of job rank ``rank`` of ``world``;
    ValueError if the centres cannot all have ``ranks_per_centre`` ranks."""
    if world % ranks_per_centre:
        raise ValueError(
            f"--ranks-per-centre {ranks_per_centre} does not divide the {world} "
            "ranks torchrun started: every centre needs as many ranks"
        )
    return rank // ranks_per_centre, world // ranks_per_centre


def topology(job: DistContext, ranks_per_centre: int) -> Topology:
    """The centres' process groups (every rank of the job calls this, in the
    same order: torch's subgroups need it)."""
    per = ranks_per_centre
    centre, count = centre_of(job.rank, job.world, per)
    if per == 1:  # a centre of one rank: the job's group is the centres'
        return Topology(job, DistContext(), DistContext(job.rank, job.world))
    inner, _ = dist.new_subgroups_by_enumeration(
        [list(range(c * per, (c + 1) * per)) for c in range(count)]
    )
    across, _ = dist.new_subgroups_by_enumeration(
        [[c * per + i for c in range(count)] for i in range(per)]
    )
    place = job.rank % per
    return Topology(
        job,
        DistContext(place, per, job.local_rank, inner),
        DistContext(centre, count, job.local_rank, across),
    )


# --- the outer step -----------------------------------------------------------------


@dataclass
class Exchange:
    """An outer exchange under way: its collectives (``work.wait()``), and
    what gives the centres' mean delta once they are done; the screening's
    verdict on the centres' deltas, the reference direction it used, and the
    centres found to send other than they reported (``mean`` fills it)."""

    works: list
    mean: Callable[[], torch.Tensor]
    verdict: Verdict | None = None
    reference: torch.Tensor | None = None
    liars: list[int] | None = None


class OuterSync:
    """The global model, its outer optimizer and the exchange of deltas for
    one centre's ``params`` (every centre holds the same, in the same order).

    ``centres``: this rank among the centres (its group: the ranks the
    exchange crosses between); ``inner``: its place in a centre of several
    ranks, which all hold the same model (DDP). Rank i of a centre then
    exchanges the i-th share of the flat delta alone, and the centre's ranks
    gather the averaged shares over their own fast network: the wide-area
    bytes are one delta per centre, over as many connections as it has ranks.

    ``shards``: instead, the centre's ranks when ``params`` are FSDP2's
    shards (``train.fsdp``): rank i then holds, steps and exchanges the
    global model of its own shards alone, and nothing is gathered but what
    a checkpoint holds (the whole global model and momentum, as any other
    centre's).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        cfg: DiLoCoConfig,
        centres: DistContext,
        inner: DistContext | None = None,
        shards: DistContext | None = None,
    ) -> None:
        self.params = params
        self.cfg = cfg
        self.centres = centres
        self.inner = inner or DistContext()
        self.shards = shards or DistContext()
        if self.inner.enabled and self.shards.enabled:
            raise ValueError("a centre's ranks share the delta, or hold shards")
        self.numel = sum(fsdp.local(p).numel() for p in params)
        self.whole_numel = sum(p.numel() for p in params)
        # a share per rank of the centre, whole int8 blocks each
        blocks = math.ceil(self.numel / INT8_BLOCK)
        per = self.inner.world
        self.share = self.numel if per == 1 else math.ceil(blocks / per) * INT8_BLOCK
        # what each of the centre's ranks exchanges: the bytes it sends
        self.share_sizes = [self.share] * per
        if self.shards.enabled:
            mine = torch.tensor([self.numel], dtype=torch.int64)
            sizes = [torch.empty_like(mine) for _ in range(self.shards.world)]
            dist.all_gather(sizes, mine, group=self.shards.group)
            self.share_sizes = [int(t) for t in sizes]
        with torch.no_grad():
            flat = self.local_flat()
        # The global model as the outer optimizer sees it: one flat tensor,
        # so one SGD step (torch's own, with Nesterov momentum) covers it.
        self.global_flat = nn.Parameter(flat, requires_grad=False)
        self.optimizer = torch.optim.SGD(
            [self.global_flat],
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
            nesterov=cfg.outer_momentum > 0,
        )
        self.steps = 0
        self.skipped_in_row = 0
        self.bytes_sent = 0
        self.guard = DeltaGuard(centres.world, cfg.delta_bound, cfg.delta_min_cosine)
        #: the last applied mean delta: the run's direction without momentum
        self.last_mean: torch.Tensor | None = None

    def local_flat(self) -> torch.Tensor:
        """The centre's own model (of this rank's shards), flat, fp32."""
        with torch.no_grad():
            return torch.cat(
                [fsdp.local(p).detach().reshape(-1).float() for p in self.params]
            )

    @torch.no_grad()
    def put_global(self, mixing: float = 0.0) -> None:
        """Every local parameter := the global model (what each centre goes
        on from), or ``mixing`` of the local one plus the rest of the global
        (Streaming DiLoCo's merge, after inner steps taken while the exchange
        was under way)."""
        offset = 0
        for p in map(fsdp.local, self.params):
            n = p.numel()
            g = self.global_flat[offset : offset + n].view_as(p)
            if mixing:
                p.mul_(mixing).add_(g.to(p.dtype), alpha=1 - mixing)
            else:
                p.copy_(g)
            offset += n

    def reference(self) -> torch.Tensor | None:
        """The run's recent direction (this rank's part): the outer momentum,
        or without one the last applied mean delta; None before either."""
        buf = self.optimizer.state.get(self.global_flat, {}).get("momentum_buffer")
        return buf if buf is not None else self.last_mean

    def screen(self, delta: torch.Tensor, reference: torch.Tensor | None) -> Verdict:
        """Every centre's delta statistics, gathered, and the verdict on them
        (the same on every centre: the same numbers, the same rules)."""
        stats = screen_stats(delta, reference)
        if self.shards.enabled:  # this rank holds shards: the centre's sum
            dist.all_reduce(stats, group=self.shards.group)
        n = self.centres.world
        if n == 1:
            return self.guard.judge(stats[None])
        parts = [torch.empty_like(stats) for _ in range(n)]
        dist.all_gather(parts, stats, group=self.centres.group)
        return self.guard.judge(torch.stack(parts).cpu())

    def start(self) -> Exchange:
        """Start the exchange of this centre's delta (``global - local`` now),
        once every centre has seen every centre's delta statistics: a centre
        out of bound sends zeros and the mean is over the others. The
        collectives run while the centre goes on training."""
        delta = self.global_flat.detach() - self.local_flat()
        reference = self.reference()
        verdict = self.screen(delta, reference)
        if verdict.reasons[self.centres.rank] is not None:
            delta = torch.zeros_like(delta)  # left out: the others' mean applies
        per = self.inner.world
        if per == 1:
            exchange = self._start_share(delta, reference, verdict)
        else:
            size = self.share * per - self.numel
            padded = torch.nn.functional.pad(delta, (0, size))
            ref_share = None
            if reference is not None:
                ref_share = torch.nn.functional.pad(reference, (0, size))
                ref_share = ref_share.view(per, -1)[self.inner.rank]
            share = self._start_share(
                padded.view(per, -1)[self.inner.rank], ref_share, verdict
            )

            def mean() -> torch.Tensor:
                mine = share.mean()
                parts = [torch.empty_like(mine) for _ in range(per)]
                dist.all_gather(parts, mine, group=self.inner.group)
                exchange.liars = share.liars
                return torch.cat(parts)[: self.numel]

            exchange = Exchange(share.works, mean)
        exchange.verdict, exchange.reference = verdict, reference
        return exchange

    def _start_share(
        self, delta: torch.Tensor, reference: torch.Tensor | None, verdict: Verdict
    ) -> Exchange:
        """Start averaging this rank's share ``delta`` over the accepted
        centres (all of it for a centre of one rank); counts the bytes the
        centre sends."""
        n, group = self.centres.world, self.centres.group
        precision = self.cfg.precision
        op = "all_reduce" if precision == "fp32" else "all_gather"
        count = max(1, len(verdict.accepted))
        # every rank of the centre sends its share: the centre's bytes
        self.bytes_sent += sum(
            ring_bytes_sent(encoded_bytes(size, precision), n, op)
            for size in self.share_sizes
        )
        if precision == "fp32":
            total = delta.clone()
            works = (
                [dist.all_reduce(total, group=group, async_op=True)] if n > 1 else []
            )
            return Exchange(works, lambda: total / count, liars=[])
        payload = encode(delta, precision)
        if n == 1:
            return Exchange(
                [], lambda: decode(payload, precision, delta.numel()), liars=[]
            )
        gathered, works = [], []
        for t in payload:
            parts = [torch.empty_like(t) for _ in range(n)]
            works.append(dist.all_gather(parts, t, group=group, async_op=True))
            gathered.append(parts)
        exchange = Exchange(works, lambda: mean(), liars=[])

        def mean() -> torch.Tensor:
            # Every accepted centre's delta as it arrived, checked against
            # what it reported; a centre caught sending another is left out.
            deltas = {
                rank: decode(
                    [parts[rank] for parts in gathered], precision, delta.numel()
                )
                for rank in verdict.accepted
            }
            stats = torch.stack(
                [screen_stats(d, reference)[:2] for d in deltas.values()]
            )
            group_of_centre = self._centre_group()
            if group_of_centre is not None:  # this rank's part of each delta
                dist.all_reduce(stats, group=group_of_centre)
            total = torch.zeros_like(delta)
            kept = 0
            for (rank, d), (sq, dot) in zip(
                deltas.items(), stats.tolist(), strict=True
            ):
                said = (verdict.norms[rank], verdict.dots[rank])
                got = (math.sqrt(max(sq, 0.0)) if math.isfinite(sq) else math.nan, dot)
                if consistent(got, said, verdict.ref_norm, TOLERANCE[precision]):
                    total += d  # in rank order: the same sum on every centre
                    kept += 1
                else:
                    exchange.liars.append(rank)
            return total / max(kept, 1)

        return exchange

    def _centre_group(self):
        """The group of this centre's ranks that hold parts of one delta (a
        share each, or shards); None when this rank holds all of it."""
        if self.shards.enabled:
            return self.shards.group
        return self.inner.group if self.inner.world > 1 else None

    def _adds_up(self, mean: torch.Tensor, exchange: Exchange) -> tuple[bool, float]:
        """fp32 deltas are summed on the way (all-reduce): no centre sees
        another's. The sum must still be what the accepted centres reported:
        no longer than their norms together, and with the dot product with
        the reference they add up to. (whether it does, its norm)"""
        verdict = exchange.verdict
        accepted = verdict.accepted
        summed = mean * len(accepted)
        stats = screen_stats(summed, exchange.reference)
        if self.shards.enabled:
            dist.all_reduce(stats, group=self.shards.group)
        norm = math.sqrt(max(float(stats[0]), 0.0))
        said = (
            sum(verdict.norms[c] for c in accepted),
            sum(verdict.dots[c] for c in accepted),
        )
        got = (norm, float(stats[1]))
        return consistent(got, said, verdict.ref_norm, TOLERANCE["fp32"]), norm

    @torch.no_grad()
    def finish(self, exchange: Exchange, mixing: float = 0.0) -> dict:
        """Wait for ``exchange``, step the global model with the accepted
        centres' mean delta and put it in place (``put_global(mixing)``);
        returns the outer step's record fields."""
        for work in exchange.works:
            work.wait()
        mean = exchange.mean()
        self.steps += 1
        record = {"outer_step": self.steps}
        verdict = exchange.verdict
        me, n = self.centres.rank, self.centres.world
        liars = list(exchange.liars or [])
        record["outer_delta_norms"] = [_json_float(x) for x in verdict.norms]
        record["outer_delta_cosines"] = [_json_float(x) for x in verdict.cosines]
        for c in verdict.refused:
            log.warning(
                "outer step %d: centre %d's delta left out: %s (a centre that "
                "diverged or sends a wrong delta); the mean of the other %d applied",
                self.steps,
                c,
                verdict.reasons[c],
                len(verdict.accepted),
            )
        for c in liars:
            log.warning(
                "outer step %d: centre %d's delta left out: it is not the delta "
                "it reported (its norm and direction differ from its report)",
                self.steps,
                c,
            )
        kept = [c for c in verdict.accepted if c not in liars]
        problem = None
        if not kept and all("not finite" in r for r in verdict.reasons):
            problem = "the averaged delta is not finite"
        elif not kept:
            problem = "no centre's delta is within bounds"
        elif not bool(torch.isfinite(mean).all()):
            problem = "the averaged delta is not finite"
        elif n > 1 and self.cfg.precision == "fp32":
            fits, norm = self._adds_up(mean, exchange)
            if not fits:
                who = f"centre {1 - me}" if n == 2 else "a centre"
                problem = (
                    f"the centres' deltas add up to a norm of {norm:.4g}, more "
                    f"than the {sum(verdict.norms[c] for c in kept):.4g} they "
                    f"reported: {who} sends a delta other than the one it reports"
                )
        self.guard.record(verdict, liars if problem is None else list(range(n)))
        if refused := [c for c in range(n) if c not in kept]:
            record["outer_refused"] = refused
        worst = max(range(n), key=lambda c: self.guard.refused_in_row[c])
        if problem is None and self.guard.refused_in_row[worst] >= self.cfg.max_skipped:
            reason = verdict.reasons[worst] or "it is not the delta it reported"
            raise OuterStepError(
                f"centre {worst}'s delta was out of bound at "
                f"{self.guard.refused_in_row[worst]} outer steps in a row (now: "
                f"{reason}); it diverged or sends wrong deltas: stop it and resume "
                "the others without it (docs/cross_centre.md, a centre lost for "
                "good); the last checkpoint holds the last good global model"
            )
        if problem is not None:
            self.skipped_in_row += 1
            self.put_global()  # the H steps are dropped, on every centre alike
            log.warning(
                "outer step %d skipped: %s (%d in a row)",
                self.steps,
                problem,
                self.skipped_in_row,
            )
            if self.skipped_in_row >= self.cfg.max_skipped:
                hint = (
                    "a centre diverged: lower --lr or --outer-lr"
                    if "not finite" in problem
                    else problem
                )
                raise OuterStepError(
                    f"{self.skipped_in_row} outer steps in a row were skipped "
                    f"({hint}); the last checkpoint holds the last good global model"
                )
            return {**record, "outer_skipped": True}
        self.skipped_in_row = 0
        self.global_flat.grad = mean
        self.optimizer.step()
        self.global_flat.grad = None
        if self.cfg.outer_momentum == 0:
            self.last_mean = mean.clone()
        # a centre left out goes on from the global model alone
        self.put_global(0.0 if me not in kept else mixing)
        record["outer_delta_norm"] = float(mean.norm())
        return record

    def step(self) -> dict:
        """One whole outer step (start, then finish at once)."""
        return {**self.finish(self.start()), "outer_bytes_sent": self.bytes_sent}

    def state_tensors(self, prefix: str = "outer.") -> dict[str, torch.Tensor]:
        """The outer optimizer's momentum and steps, the bytes sent so far,
        and the global model where it is not the model's own weights (a
        fragment synchronised earlier, or merged with ``mixing``)."""
        buf = self.optimizer.state.get(self.global_flat, {}).get("momentum_buffer")
        out = {
            f"{prefix}steps": torch.tensor([self.steps], dtype=torch.int64),
            f"{prefix}bytes_sent": torch.tensor([self.bytes_sent], dtype=torch.int64),
            # the same on every centre: what the next outer step bounds against
            f"{prefix}delta_history": self.guard.state(),
        }
        differs = not torch.equal(self.global_flat.detach(), self.local_flat())
        if self.shards.enabled:  # whole, as every centre's: every rank gathers
            flag = torch.tensor([int(differs)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.shards.group)
            differs = bool(flag)
        for name, t in (("momentum", buf), ("global", self.global_flat)):
            if t is not None and (name == "momentum" or differs):
                t = t.detach()
                if self.shards.enabled:
                    t = fsdp.whole_flat(t, self.params)
                out[f"{prefix}{name}"] = t.cpu()
        return out

    def load_state(
        self, tensors: dict[str, torch.Tensor], source: str, prefix: str = "outer."
    ) -> None:
        if f"{prefix}steps" not in tensors:
            raise ckpt.CheckpointError(
                f"{source}: no {prefix}steps: written with other --fragments"
            )
        self.steps = int(tensors[f"{prefix}steps"][0])
        sent = tensors.get(f"{prefix}bytes_sent")  # (absent in older checkpoints)
        if sent is not None:
            if sent.dtype != torch.int64 or sent.shape != (1,) or int(sent) < 0:
                raise ckpt.CheckpointError(
                    f"{source}: {prefix}bytes_sent is not one count of bytes"
                )
            self.bytes_sent = int(sent)
        n = self.whole_numel
        for what in ("momentum", "global"):
            t = tensors.get(f"{prefix}{what}")
            if t is not None and (t.dtype != torch.float32 or t.shape != (n,)):
                raise ckpt.CheckpointError(
                    f"{source}: outer {what} of {t.numel()} {t.dtype} values, "
                    f"the model's share has {n} float32 ones"
                )
            if t is not None and self.shards.enabled:
                tensors = {
                    **tensors,
                    f"{prefix}{what}": fsdp.shard_flat(t, self.params),
                }
        history = tensors.get(f"{prefix}delta_history")  # (absent in older ones)
        if history is not None and history.dtype != torch.float64:
            raise ckpt.CheckpointError(
                f"{source}: {prefix}delta_history is not float64"
            )
        try:
            self.guard.load(history)
        except ValueError as e:
            raise ckpt.CheckpointError(f"{source}: {prefix}{e}") from None
        glob = tensors.get(f"{prefix}global")
        self.global_flat.data.copy_(self.local_flat() if glob is None else glob)
        buf = tensors.get(f"{prefix}momentum")
        if buf is not None:
            self.optimizer.state[self.global_flat] = {
                "momentum_buffer": buf.to(self.global_flat.device)
            }


# --- the executor ------------------------------------------------------------------


class DiLoCoExecutor(Executor):
    """A centre's local executor, with an outer step every ``inner_steps``
    (for each fragment of the model, at its own step)."""

    def __init__(
        self, inner, syncs: list[OuterSync], cfg: DiLoCoConfig, where: Topology
    ) -> None:
        """``inner``: a ``train.executor.LocalExecutor`` (DDP over
        ``where.inner`` for a centre of several ranks; its checkpoints carry
        the outer optimizer's state too); ``syncs``: one per fragment."""
        self.inner = inner
        self.syncs = syncs
        self.cfg = cfg
        self.where = where
        self.under_way: dict[int, Exchange] = {}  # fragment -> its exchange
        inner.extra_files = lambda: {OUTER_FILE: self._state_tensors()}

    def step(self, step: int, batch: StepBatch) -> dict:
        try:
            record = self.inner.step(step, batch)
        except RuntimeError as e:
            if not _collective_failed(e):
                raise
            # DDP inside the centre: one of its ranks gone
            raise self._failed(e, f"step {step + 1}", "a rank of this centre") from None
        done, f = step + 1, None
        try:
            for f, sync in enumerate(self.syncs):
                if self.cfg.due(done, f, self.cfg.overlap_steps):
                    self.under_way[f] = sync.start()
            last = done == self.inner.cfg.steps
            for f, sync in enumerate(self.syncs):
                if self.cfg.due(done, f):
                    # the run's last outer step puts the global model in place
                    # whole, so every centre ends with the same one
                    mixing = 0.0 if last else self.cfg.merge
                    record.update(sync.finish(self.under_way.pop(f), mixing))
                    if len(self.syncs) > 1:
                        record["fragment"] = f
                elif last:  # the fragments synchronised earlier: once more
                    record.update(sync.step())
        except RuntimeError as e:  # gloo / NCCL: a centre gone, a timeout
            if isinstance(e, OuterStepError):
                raise
            n = self.syncs[f].steps + 1 if f is not None else 1
            what = f"outer step {n} (after step {done})"
            if len(self.syncs) > 1:
                what = f"fragment {f}'s {what}"
            raise self._failed(e, what, "another centre") from None
        if "outer_step" in record:
            record["outer_bytes_sent"] = self.bytes_sent
        return record

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.syncs)

    def _failed(self, e: BaseException, what: str, who: str) -> RunFailedError:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return RunFailedError(
            f"{self.where.name(self.where.job.rank)}: {what} failed: {first}; "
            f"{who} stopped or the link broke. The last checkpoint of every "
            "centre is an outer step's: run again with --resume"
        )

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """``split``: this rank's rows of every global batch, as DDP's ranks
        take them; ``own``: its share of its centre's batch."""
        if self.cfg.data == "split":
            return self.where.job.shard(batch)
        return self.where.inner.shard(batch)

    def eval_model(self) -> nn.Module:
        return self.inner.eval_model()

    @property
    def collective(self) -> bool:
        return self.inner.collective

    def log_suffix(self, record: dict) -> str:
        if "outer_step" not in record:
            return ""
        which = f" of fragment {record['fragment']}" if "fragment" in record else ""
        sent = record["outer_bytes_sent"]
        return f" (outer step {record['outer_step']}{which}, {sent} B sent so far)"

    def _prefix(self, fragment: int) -> str:
        return "outer." if len(self.syncs) == 1 else f"outer.{fragment}."

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for f, sync in enumerate(self.syncs):
            out.update(sync.state_tensors(self._prefix(f)))
        return out

    def save(self, run: RunDir, step: int, state: dict, keep: int) -> None:
        if step % self.cfg.inner_steps or self.under_way:
            raise AssertionError(f"step {step}: DiLoCo checkpoints after outer steps")
        self.inner.save(run, step, state, keep)

    def load(self, folder: Path | None) -> dict | None:
        state = self.inner.load(folder)
        if folder is not None:
            source = str(folder / OUTER_FILE)
            tensors = ckpt.read_tensors(folder / OUTER_FILE)
            for f, sync in enumerate(self.syncs):
                sync.load_state(tensors, source, self._prefix(f))
        else:
            for sync in self.syncs:
                sync.global_flat.data.copy_(sync.local_flat())
        return state

    def summary(self, steps_run: int) -> dict:
        return {
            **self.inner.summary(steps_run),
            "outer_steps": self.syncs[-1].steps,
            "outer_bytes_sent": self.bytes_sent,
        }


def _json_float(x: float) -> float | None:
    """A number for a metrics row (JSON has no NaN)."""
    return x if math.isfinite(x) else None


def fragments_of(params: list[nn.Parameter], count: int) -> list[list[nn.Parameter]]:
    """``params`` in ``count`` runs of about equal size, in order (a whole
    tensor in each: the blocks of a transformer fall into runs of blocks)."""
    if count > len(params):
        raise ValueError(
            f"--fragments {count}: this run trains {len(params)} tensors, "
            "fewer than the fragments asked for"
        )
    total, n = sum(p.numel() for p in params), len(params)
    out: list[list[nn.Parameter]] = []
    seen = 0
    for i, p in enumerate(params):
        # the fragment its middle falls in, opening one at a time and leaving
        # a tensor for each fragment still to open
        wanted = int((seen + p.numel() / 2) * count / total)
        last = len(out) - 1
        at = min(max(wanted, last, count - (n - i)), last + 1, count - 1)
        if at > last:
            out.append([])
        out[-1].append(p)
        seen += p.numel()
    return out


def _collective_failed(e: RuntimeError) -> bool:
    """Whether ``e`` is a collective's failure (DDP's reducer raises gloo's
    and NCCL's as plain RuntimeErrors), not a fault of the step itself."""
    return isinstance(e, dist.DistError) or any(
        word in str(e) for word in ("gloo", "NCCL", "Connection closed", "timed out")
    )


# --- agreeing to the same run -------------------------------------------------------


def fingerprints(**groups) -> dict[str, int]:
    """One 63-bit hash per named group of settings, to compare across centres
    without sending (or unpickling) the settings themselves."""
    out = {}
    for name, value in groups.items():
        digest = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).digest()
        out[name] = int.from_bytes(digest[:8], "big") >> 1
    return out


def check_same_run(mine: dict[str, int], where: Topology) -> None:
    """Refuse to start unless every rank of every centre has the same
    settings of each group, naming the groups and centres that differ."""
    job = where.job
    if job.world <= 1:
        return
    names = sorted(mine)
    t = torch.tensor([mine[n] for n in names], dtype=torch.int64)
    parts = [torch.empty_like(t) for _ in range(job.world)]
    dist.all_gather(parts, t)
    diffs = [
        f"{where.name(rank)}'s {name}"
        for rank, theirs in enumerate(parts)
        for i, name in enumerate(names)
        if int(theirs[i]) != int(t[i]) and rank != job.rank
    ]
    if diffs:
        # Every rank found it and stops here: leave together, so that none
        # tears its process group down under another still using it.
        dist.barrier()
        raise ValueError(
            f"{where.name(job.rank)}: {', '.join(diffs)} differ from this "
            "one's; every centre must run the same model, seed, steps and "
            "--sync settings"
        )


# --- a centre's run -------------------------------------------------------------


def centre_settings(
    cfg: TrainConfig,
    sync: DiLoCoConfig,
    world: int,
    rank: int,
    data_dirs: list,
) -> tuple[TrainConfig, list]:
    """Job rank ``rank``'s training settings and data: its share of every
    global batch (``split``: rows of the same data, as DDP's ranks; ``own``:
    its centre reads its own folder, as many rows as a centre's share), checked
    to fit the outer steps."""
    h = sync.inner_steps
    if cfg.steps % h:
        raise ValueError(
            f"--steps {cfg.steps} is not a multiple of --inner-steps {h}: the "
            "run would end between outer steps, with every centre's model apart"
        )
    if cfg.ckpt_every % h:
        raise ValueError(
            f"--ckpt-every {cfg.ckpt_every} is not a multiple of --inner-steps "
            f"{h}: a checkpoint is taken after an outer step, where the centres agree"
        )
    centre, centres = centre_of(rank, world, sync.ranks_per_centre)
    per = per_rank_micro_batches(cfg, world)
    if sync.data == "split":
        return per, list(data_dirs)
    if len(data_dirs) != centres:
        raise ValueError(
            f"--centre-data own: give one --data folder per centre ({centres} "
            f"centres, {len(data_dirs)} folders); centre i reads the i-th"
        )
    return replace(per, batch_size=cfg.batch_size // centres), [data_dirs[centre]]


def centre_folder(out: str | Path, centre: int) -> Path:
    """Centre ``centre``'s run folder (centre 0's is the run's own)."""
    return Path(out) if centre == 0 else Path(out) / "centres" / str(centre)


def joining_centres(run: RunDir, where: Topology, *, resume: bool) -> list[int]:
    """The centres that join a run under way: those without a checkpoint
    while others resume from theirs (a centre added to the job with an empty
    folder and ``--resume auto``, or one that joined and was stopped before
    its first checkpoint: it has nothing of its own to lose). ValueError, on
    every centre alike, if a centre was asked to resume (``--resume``) a
    folder that holds no run: a centre refusing alone would leave the others
    waiting for it until the timeout."""
    if where.job.world <= 1:
        if resume:
            check_resumable(run.path)
        return []
    per = where.inner.world  # a centre's ranks read the same folder
    mine = [resume, holds_run(run.path), bool(ckpt.complete_steps(run.checkpoints))]
    flags = torch.tensor(mine, dtype=torch.int64)
    gathered = [torch.empty_like(flags) for _ in range(where.job.world)]
    dist.all_gather(gathered, flags)
    asked, holds, saved = (
        [bool(gathered[c * per][i]) for c in range(where.centres)] for i in range(3)
    )
    refused = [c for c in range(where.centres) if asked[c] and not holds[c]]
    if refused:
        shown = ", ".join(f"centre {c}" for c in refused)
        raise ValueError(
            f"--resume: nothing to resume in the folder of {shown} (no "
            "config.json); every centre needs its own run folder (centre "
            "k: OUT/centres/<k>); a centre joining the run takes --resume auto"
        )
    if not any(asked[c] and saved[c] for c in range(where.centres)):
        return []  # nobody resumes from a checkpoint: all start at step 0
    return [c for c in range(where.centres) if not saved[c]]


def agreed_checkpoint(
    run: RunDir,
    last: Path | None,
    where: Topology,
    joining: list[int] = (),
    total_steps: int = 2**62,
) -> Path | None:
    """The newest checkpoint every centre has (each keeps its last few): the
    one they all resume from. ``joining`` centres have none and take no
    part; one is refused if the run is already at its ``total_steps``. None
    for a fresh run; ValueError if they have none in common. (A centre's
    ranks read its one folder: shared storage inside a centre, as DDP's
    ranks need.)"""
    job = where.job
    if job.world <= 1:
        return last
    steps = ckpt.complete_steps(run.checkpoints) if last is not None else []
    t = torch.full((8,), -1, dtype=torch.int64)
    t[: min(8, len(steps))] = torch.tensor(steps[-8:], dtype=torch.int64)
    parts = [torch.empty_like(t) for _ in range(job.world)]
    dist.all_gather(parts, t)
    have = [{int(x) for x in p if int(x) >= 0} for p in parts]
    per = where.inner.world
    resuming = [h for r, h in enumerate(have) if r // per not in joining]
    if not any(resuming):
        return None
    common = set.intersection(*resuming)
    if not common:
        shown = ", ".join(
            f"centre {c}: {sorted(have[c * per]) or 'none'}"
            for c in range(where.centres)
            if c not in joining
        )
        raise ValueError(
            f"the centres have no checkpoint step in common ({shown}); "
            "resume needs the same outer step at every centre (after a centre "
            "lost for good, those after it move down a rank: move their "
            "centres/<k> folders down with them)"
        )
    if where.centre in joining:
        if max(common) >= total_steps:  # the others stop there: none to join
            raise ValueError(
                f"the run is already at step {max(common)} of {total_steps}: "
                "nothing to join (raise --steps on every centre to go on)"
            )
        return None  # it is brought to that step by ``admit``
    return ckpt.step_folder(run.checkpoints, max(common))


def admit(
    executor: DiLoCoExecutor,
    objective,
    engine,
    start: int,
    joining: list[int],
) -> int:
    """Bring the ``joining`` centres to where the others resumed (step
    ``start``), and return the step every centre goes on from. The first
    resuming centre sends, rank by rank over the exchange's groups, what every
    centre already holds alike: the step, the global model (and each
    fragment's), the outer momentum and the outer step count, and, where the
    centres share the data (``--centre-data split``), the position in it. A
    joiner puts the global model in place and starts its AdamW afresh: the
    others' moments come from their own data and stay with them. With its
    own data, a joiner reads its domain from the start."""
    where = executor.where
    if not joining:
        return start
    source = min(c for c in range(where.centres) if c not in joining)
    src = source * where.inner.world + where.inner.rank  # a job rank
    group, mine = where.across.group, where.centre in joining
    sampler = objective.sampler
    head = torch.tensor(
        [start, sampler.epoch, sampler.position, engine.tokens], dtype=torch.int64
    )
    dist.broadcast(head, src, group=group)
    for sync in executor.syncs:
        buf = sync.optimizer.state.get(sync.global_flat, {}).get("momentum_buffer")
        meta = torch.tensor([sync.steps, int(buf is not None)], dtype=torch.int64)
        dist.broadcast(meta, src, group=group)
        dist.broadcast(sync.global_flat.data, src, group=group)
        # the norms every centre's next deltas are bounded against: the same
        history = sync.guard.history.to(sync.global_flat.device)  # (NCCL: the GPU)
        dist.broadcast(history, src, group=group)
        history = history.cpu()
        if int(meta[1]):
            if buf is None:
                buf = torch.empty_like(sync.global_flat.data)
            dist.broadcast(buf, src, group=group)
        if mine:
            if int(meta[0]) < 0 or int(meta[1]) not in (0, 1):
                raise ValueError(f"centre {source} sent a corrupt outer state")
            sent = [sync.global_flat] + ([buf] if int(meta[1]) else [])
            if not bool(torch.isfinite(history).all()) or bool((history < 0).any()):
                raise ValueError(f"centre {source} sent a corrupt delta history")
            if not all(bool(torch.isfinite(t).all()) for t in sent):
                raise ValueError(
                    f"centre {source} sent a non-finite global model or momentum"
                )
            sync.steps = int(meta[0])
            sync.guard.history.copy_(history)
            if int(meta[1]):
                sync.optimizer.state[sync.global_flat] = {"momentum_buffer": buf}
            sync.put_global()
    step, epoch, position, tokens = (int(x) for x in head)
    if mine:
        if not 0 <= step < executor.inner.cfg.steps or tokens < 0:
            raise ValueError(
                f"centre {source} sent step {step} and {tokens} tokens: not a "
                f"point of this run of {executor.inner.cfg.steps} steps"
            )
        engine.tokens = tokens
        if executor.cfg.data == "split":  # the same global batches
            if epoch < 0 or not 0 <= position < sampler.total:
                raise ValueError(
                    f"centre {source} sent a data position (epoch {epoch}, "
                    f"sample {position}) outside this centre's {sampler.total} "
                    "samples: the centres do not read the same data"
                )
            state = {**sampler.state_dict(), "epoch": epoch, "position": position}
            sampler.load_state_dict(state)
        log.info(
            "centre %d joins the run at step %d (from centre %d's global model)",
            where.centre,
            step,
            source,
        )
    elif where.inner.is_main and where.centre == source:
        shown = ", ".join(f"centre {c}" for c in joining)
        log.info("%s joined the run at step %d", shown, step)
    return step


def check_resume(run: RunDir, config: dict) -> None:
    """Refuse, before the run folder is touched, to resume a run with
    ``config`` (this start's run config) under another regime than its
    checkpoints were written by: DiLoCo's without
    ``--sync diloco`` (its outer momentum would be dropped unsaid), another
    run's with it (there is no outer state to read), or with another number
    of fragments. Another number of centres than the run had (one lost for
    good) is allowed, and said."""
    old = run.read_config()
    was, sync = old.get("sync"), config.get("sync")
    if was is None and sync is None:
        return
    if not isinstance(was, dict | None):
        raise ValueError(f"{run.path}: corrupt run config: its sync is not a table")
    if sync is None:
        raise ValueError(
            f"{run.path}: started with --sync diloco; resume it with --sync "
            "diloco (--outer-lr 1 --outer-momentum 0 to go on as plain training)"
        )
    if was is None:
        raise ValueError(
            f"{run.path}: started without --sync diloco; its checkpoints hold "
            "no outer state to resume DiLoCo from"
        )
    if (n := was.get("fragments", 1)) != sync["fragments"]:
        raise ValueError(
            f"{run.path}: started with --fragments {n}; its checkpoints hold "
            f"that many fragments' outer state: resume it with --fragments {n}"
        )
    before, centres = old.get("centres"), config["centres"]
    if isinstance(before, int) and before != centres:
        log.warning(
            "%s: a run of %d centres resumed by %d: from the last outer step, %s",
            run.path,
            before,
            centres,
            "the centres share every global batch among them"
            if sync["data"] == "split"
            else "each centre reads a larger share from its own --data",
        )


def centre_executor(
    executor, sync: DiLoCoConfig, where: Topology, config: dict
) -> DiLoCoExecutor:
    """``executor`` (a centre's local one) with DiLoCo's outer steps, once
    every rank of every centre is found to run the same training."""
    train = {k: v for k, v in config["train"].items() if k != "device"}
    sharded = executor.collective  # FSDP2 inside the centre: shards
    check_same_run(
        fingerprints(
            model=config["model"],
            train=train,
            # the ranks of a centre exchange their shares with their
            # counterparts in every other centre: laid out alike
            sync={**sync.to_dict(), "fsdp": sharded},
            tokenizer=(config.get("tokenizer") or {}).get("sha256"),
        ),
        where,
    )
    params = [p for _, p in executor.trainable]
    syncs = [
        OuterSync(part, sync, where.across, shards=where.inner)
        if sharded
        else OuterSync(part, sync, where.across, where.inner)
        for part in fragments_of(params, sync.fragments)
    ]
    return DiLoCoExecutor(executor, syncs, sync, where)

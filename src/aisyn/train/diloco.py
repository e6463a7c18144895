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
model), and ``max_skipped`` such steps in a row stop the run with one line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from aisyn.errors import RunFailedError
from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig, per_rank_micro_batches
from aisyn.train.distributed import DistContext
from aisyn.train.objective import StepBatch
from aisyn.train.regime import Executor
from aisyn.train.run import RunDir
from aisyn.validate import number_problem

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

    def __post_init__(self) -> None:
        checks = {
            "inner_steps": dict(low=1),
            "ranks_per_centre": dict(low=1),
            "outer_lr": dict(low=0, low_open=True),
            "outer_momentum": dict(low=0, high=1, high_open=True),
            "max_skipped": dict(low=1),
        }
        for name, bounds in checks.items():
            value = getattr(self, name)
            integer = name in ("inner_steps", "max_skipped", "ranks_per_centre")
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

    def to_dict(self) -> dict:
        return asdict(self)


def _flag(name: str) -> str:
    return {"precision": "delta-precision"}.get(name, name.replace("_", "-"))


# --- the delta on the wire ---------------------------------------------------------


def encode(delta: torch.Tensor, precision: str) -> list[torch.Tensor]:
    """The flat fp32 ``delta`` as what crosses: itself, a half-precision copy,
    or int8 codes with one fp32 scale per ``INT8_BLOCK`` (absmax / 127; a
    block with a non-finite value gets a NaN scale, so the receiver sees it)."""
    if precision == "fp32":
        return [delta]
    if precision in ("bf16", "fp16"):
        return [delta.to(torch.bfloat16 if precision == "bf16" else torch.float16)]
    n = delta.numel()
    padded = torch.nn.functional.pad(delta, (0, (-n) % INT8_BLOCK))
    blocks = padded.view(-1, INT8_BLOCK)
    finite = torch.isfinite(blocks).all(dim=1)
    absmax = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.where(finite, absmax / 127.0, torch.full_like(absmax, math.nan))
    codes = torch.round(torch.nan_to_num(blocks / absmax[:, None] * 127.0))
    return [codes.clamp_(-127, 127).to(torch.int8), scale]


def decode(payload: list[torch.Tensor], precision: str, numel: int) -> torch.Tensor:
    """``encode``'s inverse (up to its rounding), as flat fp32."""
    if precision != "int8":
        return payload[0].to(torch.float32)
    codes, scale = payload
    return (codes.to(torch.float32) * scale[:, None]).reshape(-1)[:numel]


def payload_bytes(payload: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


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
        per = self.inner.world
        return f"centre {rank // per}" + (f" (rank {rank})" if per > 1 else "")


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


class OuterSync:
    """The global model, its outer optimizer and the exchange of deltas for
    one centre's ``params`` (every centre holds the same, in the same order).

    ``centres``: this rank among the centres (its group: the ranks the
    exchange crosses between); ``inner``: its place in a centre of several
    ranks, which all hold the same model (DDP). Rank i of a centre then
    exchanges the i-th share of the flat delta alone, and the centre's ranks
    gather the averaged shares over their own fast network: the wide-area
    bytes are one delta per centre, over as many connections as it has ranks.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        cfg: DiLoCoConfig,
        centres: DistContext,
        inner: DistContext | None = None,
    ) -> None:
        self.params = params
        self.cfg = cfg
        self.centres = centres
        self.inner = inner or DistContext()
        self.numel = sum(p.numel() for p in params)
        # a share per rank of the centre, whole int8 blocks each
        blocks = math.ceil(self.numel / INT8_BLOCK)
        per = self.inner.world
        self.share = self.numel if per == 1 else math.ceil(blocks / per) * INT8_BLOCK
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).float() for p in params])
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

    def local_flat(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    @torch.no_grad()
    def _put_global(self) -> None:
        """Every local parameter := the global model (what each centre goes
        on from)."""
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(self.global_flat[offset : offset + n].view_as(p))
            offset += n

    def _average(self, delta: torch.Tensor) -> torch.Tensor:
        """The mean of every centre's ``delta``, the same on every rank."""
        per = self.inner.world
        if per == 1:
            return self._average_share(delta)
        padded = torch.nn.functional.pad(delta, (0, self.share * per - self.numel))
        mine = self._average_share(padded.view(per, -1)[self.inner.rank])
        parts = [torch.empty_like(mine) for _ in range(per)]
        dist.all_gather(parts, mine, group=self.inner.group)
        return torch.cat(parts)[: self.numel]

    def _average_share(self, delta: torch.Tensor) -> torch.Tensor:
        """The mean over the centres of this rank's share ``delta`` (all of it
        for a centre of one rank); counts the bytes the centre sends for it."""
        n, group = self.centres.world, self.centres.group
        precision = self.cfg.precision
        ranks = self.inner.world  # each sends a share of the same size
        if precision == "fp32":
            total = delta.clone()
            if n > 1:
                dist.all_reduce(total, group=group)
            sent = ring_bytes_sent(delta.numel() * 4, n, "all_reduce")
            self.bytes_sent += ranks * sent
            return total / n
        payload = encode(delta, precision)
        sent = ring_bytes_sent(payload_bytes(payload), n, "all_gather")
        self.bytes_sent += ranks * sent
        if n == 1:
            return decode(payload, precision, delta.numel())
        gathered = []
        for t in payload:
            parts = [torch.empty_like(t) for _ in range(n)]
            dist.all_gather(parts, t, group=group)
            gathered.append(parts)
        total = torch.zeros_like(delta)
        for rank in range(n):  # in rank order: the same sum on every centre
            payload = [parts[rank] for parts in gathered]
            total += decode(payload, precision, delta.numel())
        return total / n

    @torch.no_grad()
    def step(self) -> dict:
        """One outer step; returns its record fields."""
        delta = self.global_flat.detach() - self.local_flat()
        mean = self._average(delta)
        self.steps += 1
        record = {"outer_step": self.steps, "outer_bytes_sent": self.bytes_sent}
        if not bool(torch.isfinite(mean).all()):
            self.skipped_in_row += 1
            self._put_global()  # the H steps are dropped, on every centre alike
            log.warning(
                "outer step %d skipped: the averaged delta is not finite (%d in a row)",
                self.steps,
                self.skipped_in_row,
            )
            if self.skipped_in_row >= self.cfg.max_skipped:
                raise OuterStepError(
                    f"{self.skipped_in_row} outer steps in a row had non-finite "
                    "deltas (a centre diverged: lower --lr or --outer-lr); the "
                    "last checkpoint holds the last good global model"
                )
            return {**record, "outer_skipped": True}
        self.skipped_in_row = 0
        self.global_flat.grad = mean
        self.optimizer.step()
        self.global_flat.grad = None
        self._put_global()
        record["outer_delta_norm"] = float(mean.norm())
        return record

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The outer optimizer's momentum (the global model is the model's
        own weights right after an outer step)."""
        buf = self.optimizer.state.get(self.global_flat, {}).get("momentum_buffer")
        out = {"outer.steps": torch.tensor([self.steps], dtype=torch.int64)}
        if buf is not None:
            out["outer.momentum"] = buf.detach().cpu()
        return out

    def load_state(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        self.global_flat.data.copy_(self.local_flat())
        self.steps = int(tensors["outer.steps"][0])
        buf = tensors.get("outer.momentum")
        if buf is not None:
            if buf.shape != self.global_flat.shape:
                raise ckpt.CheckpointError(
                    f"{source}: outer momentum of {buf.numel()} values, the model "
                    f"has {self.global_flat.numel()}"
                )
            self.optimizer.state[self.global_flat] = {
                "momentum_buffer": buf.to(self.global_flat.device).float()
            }


# --- the executor ------------------------------------------------------------------


class DiLoCoExecutor(Executor):
    """A centre's local executor, with an outer step every ``inner_steps``."""

    def __init__(
        self, inner, sync: OuterSync, cfg: DiLoCoConfig, where: Topology
    ) -> None:
        """``inner``: a ``train.executor.LocalExecutor`` (DDP over
        ``where.inner`` for a centre of several ranks; its checkpoints carry
        the outer optimizer's state too)."""
        self.inner = inner
        self.sync = sync
        self.cfg = cfg
        self.where = where
        inner.extra_files = lambda: {OUTER_FILE: sync.state_tensors()}

    def step(self, step: int, batch: StepBatch) -> dict:
        try:
            record = self.inner.step(step, batch)
        except RuntimeError as e:
            if not _collective_failed(e):
                raise
            # DDP inside the centre: one of its ranks gone
            raise self._failed(e, f"step {step + 1}", "a rank of this centre") from None
        if (step + 1) % self.cfg.inner_steps == 0:
            try:
                record.update(self.sync.step())
            except RuntimeError as e:  # gloo / NCCL: a centre gone, a timeout
                if isinstance(e, OuterStepError):
                    raise
                what = f"outer step {self.sync.steps + 1} (after step {step + 1})"
                raise self._failed(e, what, "another centre") from None
        return record

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

    def log_suffix(self, record: dict) -> str:
        if "outer_step" not in record:
            return ""
        sent = record["outer_bytes_sent"]
        return f" (outer step {record['outer_step']}, {sent} B sent so far)"

    def save(self, run: RunDir, step: int, state: dict, keep: int) -> None:
        if step % self.cfg.inner_steps:
            raise AssertionError(f"step {step}: DiLoCo checkpoints after outer steps")
        self.inner.save(run, step, state, keep)

    def load(self, folder: Path | None) -> dict | None:
        state = self.inner.load(folder)
        if folder is not None:
            source = str(folder / OUTER_FILE)
            self.sync.load_state(ckpt.read_tensors(folder / OUTER_FILE), source)
        else:
            self.sync.global_flat.data.copy_(self.sync.local_flat())
        return state

    def summary(self, steps_run: int) -> dict:
        return {
            **self.inner.summary(steps_run),
            "outer_steps": self.sync.steps,
            "outer_bytes_sent": self.sync.bytes_sent,
        }


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


def agreed_checkpoint(run: RunDir, last: Path | None, where: Topology) -> Path | None:
    """The newest checkpoint every centre has (each keeps its last few): the
    one they all resume from. None for a fresh run; ValueError if they have
    none in common. (A centre's ranks read its one folder: shared storage
    inside a centre, as DDP's ranks need.)"""
    job = where.job
    if job.world <= 1:
        return last
    steps = ckpt.complete_steps(run.checkpoints) if last is not None else []
    t = torch.full((8,), -1, dtype=torch.int64)
    t[: min(8, len(steps))] = torch.tensor(steps[-8:], dtype=torch.int64)
    parts = [torch.empty_like(t) for _ in range(job.world)]
    dist.all_gather(parts, t)
    have = [{int(x) for x in p if int(x) >= 0} for p in parts]
    if not any(have):
        return None
    common = set.intersection(*have)
    if not common:
        per = where.inner.world  # a centre's ranks read the same folder
        shown = ", ".join(
            f"centre {c}: {sorted(have[c * per]) or 'none'}"
            for c in range(where.centres)
        )
        raise ValueError(
            f"the centres have no checkpoint step in common ({shown}); "
            "resume needs the same outer step at every centre"
        )
    return ckpt.step_folder(run.checkpoints, max(common))


def centre_executor(
    executor, sync: DiLoCoConfig, where: Topology, config: dict
) -> DiLoCoExecutor:
    """``executor`` (a centre's local one) with DiLoCo's outer steps, once
    every rank of every centre is found to run the same training."""
    train = {k: v for k, v in config["train"].items() if k != "device"}
    check_same_run(
        fingerprints(
            model=config["model"],
            train=train,
            sync=sync.to_dict(),
            tokenizer=(config.get("tokenizer") or {}).get("sha256"),
        ),
        where,
    )
    params = [p for _, p in executor.trainable]
    outer = OuterSync(params, sync, where.across, where.inner)
    return DiLoCoExecutor(executor, outer, sync, where)

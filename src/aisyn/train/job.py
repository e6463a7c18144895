"""One run, built once: what ``aisyn train`` and ``aisyn finetune`` share.

A driver says what its run is -- a ``Job``: where it writes, its training
settings and data, resume, DiLoCo, data parallelism -- and what it trains
(the objective, the model, its run config). ``Job.place()`` and the
``Placed`` it yields do the rest, the same way for every driver, in the
order a run needs it (torchtitan's ``Trainer.__init__`` is the model):

1. ``place()``: this rank's share of the job (per-rank micro-batches, or a
   DiLoCo centre's settings and data), its log lines' label, its device and
   process group -- torn down on exit however the run ends;
2. ``check_memory``: the model's peak on this rank's device, before any
   weight is built;
3. ``resume``: the ONE resume decision -- the latest checkpoint, or the one
   every centre has; one compatibility check per component (the model and
   the sync here, what the driver adds: method, base); a run already at its
   steps returns its summary without touching the folder;
4. ``start``: the run folder and its config record (a centre's rank 0);
5. ``executor`` and ``engine``: the local executor (under DiLoCo, wrapped in
   its outer steps), the regime, the engine and the step to go on from.

The split data party (``split.client.train``) resumes from the step both
parties have and passes its own executor; it shares ``open_engine``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from aisyn.model.families import ModelConfig
from aisyn.train import checkpoint as ckpt
from aisyn.train import diloco, distributed
from aisyn.train.config import TrainConfig, per_rank_micro_batches
from aisyn.train.device import autocast_on, resolve_device
from aisyn.train.diloco import DiLoCoConfig
from aisyn.train.distributed import DistContext
from aisyn.train.engine import Engine, finished
from aisyn.train.executor import LocalExecutor
from aisyn.train.memory import check_fits, whole_model_bytes
from aisyn.train.objective import Objective
from aisyn.train.regime import Regime
from aisyn.train.run import RunDir

#: a compatibility check of a resumed run: (its folder, this start's config);
#: raises ValueError naming what differs
ResumeCheck = Callable[[RunDir, dict], None]


@dataclass(frozen=True)
class Job:
    """What one run is, before anything is placed or built."""

    out: Path
    train: TrainConfig
    data: Sequence[str | Path]
    resume: bool = False
    #: DiLoCo across torchrun's ranks (a centre each, or of
    #: ``sync.ranks_per_centre`` ranks); None: one data-parallel job
    sync: DiLoCoConfig | None = None
    sync_timeout_s: float | None = None
    #: ``ddp`` or ``fsdp`` over the job's ranks, or a centre's
    parallel: str = "ddp"
    progress: bool = True
    tensorboard: bool = False

    @contextlib.contextmanager
    def place(self) -> Iterator[Placed]:
        """This rank's place in the job, its process group up for the
        ``with`` block and torn down after it (a group left up aborts the
        process at exit)."""
        world, rank = distributed.world_size(), distributed.rank()
        cfg, data, centre, centres = self.train, list(self.data), 0, 1
        if self.sync is None:
            cfg = per_rank_micro_batches(cfg, world)
        else:
            cfg, data = diloco.centre_settings(cfg, self.sync, world, rank, data)
            centre, centres = diloco.centre_of(rank, world, self.sync.ranks_per_centre)
        timeout = None
        if self.sync_timeout_s is not None:
            timeout = timedelta(seconds=self.sync_timeout_s)
        with contextlib.ExitStack() as stack:
            if self.sync is not None:  # each centre's log lines say whose they are
                label = diloco.centre_label(rank, self.sync.ranks_per_centre)
                stack.callback(diloco.label_logs(label))
            ctx, device = distributed.setup(resolve_device(cfg.device), timeout)
            stack.callback(distributed.teardown, ctx)
            placed = Placed(
                self, cfg, data, centre, centres, ctx, device,
                RunDir(diloco.centre_folder(self.out, centre)),
            )  # fmt: skip
            stack.callback(placed.release)  # (before the teardown)
            yield placed


@dataclass
class Placed:
    """A job at this rank: its settings and data, its centre, its process
    group and device, its run folder; then, as the driver goes on, the
    checkpoint it resumes from and the centres that join it."""

    job: Job
    cfg: TrainConfig
    data: list
    centre: int
    centres: int
    ctx: DistContext
    device: torch.device
    run: RunDir
    where: diloco.Topology | None = None
    joining: list[int] = field(default_factory=list)
    last: Path | None = None
    #: the executors built here, released before the process group goes
    executors: list = field(default_factory=list)

    def __post_init__(self) -> None:
        # DDP's ranks: the job's; a DiLoCo centre's: its own (one, or several)
        if self.job.sync is not None:
            self.where = diloco.topology(self.ctx, self.job.sync.ranks_per_centre)

    @property
    def ranks(self) -> DistContext:
        """The ranks that train one model together (DDP's or FSDP2's)."""
        return self.where.inner if self.where is not None else self.ctx

    @property
    def shard(self) -> tuple[int, int] | None:
        """This rank's FSDP2 shards (rank, of ranks); None: whole weights."""
        ranks = self.ranks
        fsdp = self.job.parallel == "fsdp" and ranks.enabled
        return (ranks.rank, ranks.world) if fsdp else None

    def check_memory(
        self,
        model: ModelConfig,
        seq_len: int,
        what: str,
        *,
        trains_all_weights: bool = True,
    ) -> None:
        """Refuse, in one line, a model whose training does not fit this
        rank's device (``model.memory``'s estimate; ``trains_all_weights``
        False: LoRA keeps no gradients or optimizer state for the base)."""
        shard = self.shard
        cfg = self.cfg
        check_fits(
            whole_model_bytes(
                model,
                # rank_load counts a micro-batch's rows of all the ranks
                cfg.micro * (shard[1] if shard else 1),
                seq_len,
                autocast=autocast_on(self.device, cfg.autocast),
                activation_checkpointing=cfg.activation_checkpointing,
                trains_all_weights=trains_all_weights,
                shard=shard,
            ),
            self.device,
            f"{what} with micro-batches of {cfg.micro}"
            + (f", FSDP2 over {shard[1]} ranks" if shard else ""),
        )

    def record(self, config: dict) -> dict:
        """``config`` with what the placement adds to the run's record: the
        data parallelism over several ranks, DiLoCo's settings and centre."""
        if self.ranks.enabled:
            config["data_parallel"] = self.job.parallel
        if self.job.sync is not None:
            config.update(
                sync=self.job.sync.to_dict(), centre=self.centre, centres=self.centres
            )
        return config

    def resume(self, config: dict, checks: Sequence[ResumeCheck] = ()) -> dict | None:
        """The one resume decision, made before the folder is rewritten or a
        weight built: sets ``last`` (the checkpoint to go on from: the latest,
        or the newest every centre has; None: a fresh start) and ``joining``
        (centres without a checkpoint while others resume); checks the run
        against ``config`` component by component (the model, the sync, then
        ``checks``); returns the run's summary when it is already at its
        steps (nothing to train), else None."""
        job, run = self.job, self.run
        self.last = ckpt.latest(run.checkpoints) if job.resume else None
        if self.where is not None:
            self.joining = diloco.joining_centres(run, self.where, resume=job.resume)
            self.last = diloco.agreed_checkpoint(
                run, self.last, self.where, self.joining, self.cfg.steps
            )
        if self.last is None:
            return None
        for check in (RunDir.check_same_model, diloco.check_resume, *checks):
            check(run, config)
        return finished(run, self.last, self.cfg.steps)

    def start(self, config: dict, tokenizer: Path) -> None:
        """Write the run folder (a centre's rank 0; every centre keeps its
        own), the others waiting until it is there."""
        if self.ranks.is_main:
            self.run.start(config, resume=self.job.resume, tokenizer=tokenizer)
        self.ranks.barrier()

    def executor(self, model, trainable, config: dict, **kw):
        """The local executor of ``trainable`` (DDP or FSDP2 over this
        centre's ranks), wrapped in DiLoCo's outer steps under ``sync``."""
        executor = LocalExecutor(
            model, trainable, self.cfg, ctx=self.ranks, parallel=self.job.parallel, **kw
        )
        if self.job.sync is not None:
            executor = diloco.centre_executor(
                executor, self.job.sync, self.where, config
            )
        self.executors.append(executor)
        return executor

    def release(self) -> None:
        """Drop what holds the process group (DDP's reducer) while it is up."""
        for executor in self.executors:
            executor.release()

    def train(self, objective: Objective, executor, desc: str | None = None) -> dict:
        """Run the job's steps from where the resume decision left it;
        returns the engine's summary (without its records)."""
        regime, engine, start = open_engine(
            self.run, objective, executor, self.cfg, self.last,
            device=self.device, resume=self.job.resume, main=self.ranks.is_main,
            progress=self.job.progress, tensorboard=self.job.tensorboard, desc=desc,
        )  # fmt: skip
        if self.job.sync is not None:
            start = diloco.admit(executor, objective, engine, start, self.joining)
        summary = engine.run(regime, range(start, self.cfg.steps))
        del summary["records"]
        return summary


def open_engine(
    run: RunDir,
    objective: Objective,
    executor,
    cfg: TrainConfig,
    folder: Path | None,
    *,
    device: torch.device | None,
    resume: bool,
    main: bool = True,
    progress: bool = True,
    tensorboard: bool = False,
    desc: str | None = None,
) -> tuple[Regime, Engine, int]:
    """The regime (``objective`` x ``executor``), the engine of ``cfg``'s
    steps and cadence, and the step to go on from (checkpoint ``folder``
    restored; None: step 0). ``device``: where the objective's batches go
    (None: the objective was started already)."""
    if device is not None:
        objective.start(device)
    regime = Regime(objective, executor, cfg, run)
    engine = Engine.for_config(
        run,
        cfg,
        desc=desc or objective.desc,
        progress=progress,
        main=main,
        tensorboard=tensorboard,
    )
    return regime, engine, engine.restore(regime, folder, resume=resume)

"""A centre's run: its settings and folder, agreeing to the same run, centres
joining, resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig, per_rank_micro_batches
from aisyn.train.diloco.config import DiLoCoConfig
from aisyn.train.diloco.executor import DiLoCoExecutor, fragments_of
from aisyn.train.diloco.outer import OuterSync
from aisyn.train.diloco.topology import Topology, centre_of
from aisyn.train.run import RunDir
from aisyn.validate import check_resumable, holds_run

log = logging.getLogger(__name__)

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

"""``aisyn train``: language-model pre-training of the whole model here.

The language-model objective on the local executor, single-process or
data-parallel under ``torchrun``; the plain baseline that split training
must match to 1e-5. With ``sync`` (``--sync diloco``) each torchrun rank is a
centre that trains on its own (or each ``--ranks-per-centre`` ranks, DDP
among them), the centres meeting every H steps (``train.diloco``); centre 0
writes the run folder, centre k one of its own, ``OUT/centres/<k>/`` (on its
machine), and each resumes from its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from aisyn.model.families import ModelConfig, build_model, hf_folder
from aisyn.train import checkpoint as ckpt
from aisyn.train import diloco, distributed
from aisyn.train.config import TrainConfig, per_rank_micro_batches
from aisyn.train.device import autocast_on, resolve_device
from aisyn.train.diloco import DiLoCoConfig
from aisyn.train.engine import Engine, finished
from aisyn.train.executor import LocalExecutor
from aisyn.train.memory import check_fits, whole_model_bytes
from aisyn.train.models import (
    check_base_tokenizer,
    load_model_checkpoint,
    model_config_for,
)
from aisyn.train.objective import LMObjective
from aisyn.train.regime import Regime
from aisyn.train.run import RunDir, run_config


def train(
    model_config: ModelConfig | str,
    data_dirs: Sequence[str | Path],
    out: str | Path,
    cfg: TrainConfig,
    *,
    resume: bool = False,
    init_from: str | Path | None = None,
    progress: bool = True,
    tensorboard: bool = False,
    sync: DiLoCoConfig | None = None,
    sync_timeout_s: float | None = None,
    parallel: str = "ddp",
) -> dict:
    """Train from scratch (or ``init_from`` a checkpoint) and write a run folder.

    Returns a summary: final loss, steps, tokens, elapsed seconds, run path.
    ``sync``: DiLoCo across torchrun's ranks, a centre each, or centres of
    ``sync.ranks_per_centre`` ranks running DDP inside
    (``sync_timeout_s``: how long a centre waits for the others);
    ``parallel``: ``ddp`` or ``fsdp`` (FSDP2, ``train.fsdp``) over the ranks
    of the job, or of a centre.
    """
    world, rank = distributed.world_size(), distributed.rank()
    centre = None
    if sync is None:
        cfg = per_rank_micro_batches(cfg, world)
    else:
        cfg, data_dirs = diloco.centre_settings(cfg, sync, world, rank, data_dirs)
        centre, centres = diloco.centre_of(rank, world, sync.ranks_per_centre)
    objective = LMObjective(data_dirs, cfg)
    mcfg = model_config_for(
        model_config, objective.tokenizer, objective.seq_len, data_dirs
    )
    if init_from is None and isinstance(model_config, str | Path):
        if hf_folder(model_config) is not None:
            init_from = model_config  # a pretrained folder brings its weights
    elif init_from is not None and hf_folder(init_from) is not None:
        check_base_tokenizer(init_from, objective.tokenizer, data_dirs[0])
    run = RunDir(out if not centre else diloco.centre_folder(out, centre))
    last = ckpt.latest(run.checkpoints) if resume else None
    timeout = None if sync_timeout_s is None else timedelta(seconds=sync_timeout_s)
    unlabel = None
    if sync is not None:  # each centre's log lines say whose they are
        unlabel = diloco.label_logs(diloco.centre_label(rank, sync.ranks_per_centre))
    try:
        ctx, device = distributed.setup(resolve_device(cfg.device), timeout)
    except BaseException:
        if unlabel is not None:
            unlabel()
        raise
    try:
        # DDP's ranks: the job's; a DiLoCo centre's: its own (one, or several)
        ranks = ctx
        if sync is not None:
            where = diloco.topology(ctx, sync.ranks_per_centre)
            ranks = where.inner
            joining = diloco.joining_centres(run, where, resume=resume)
            last = diloco.agreed_checkpoint(run, last, where, joining, cfg.steps)
        # FSDP2: this rank's shards (rank_load counts a micro-batch's rows
        # of all the ranks together)
        fsdp = parallel == "fsdp" and ranks.enabled
        shard = (ranks.rank, ranks.world) if fsdp else None
        check_fits(
            whole_model_bytes(
                mcfg,
                cfg.micro * (ranks.world if shard else 1),
                objective.seq_len,
                autocast=autocast_on(device, cfg.autocast),
                activation_checkpointing=cfg.activation_checkpointing,
                shard=shard,
            ),
            device,
            f"training with micro-batches of {cfg.micro}"
            + (f", FSDP2 over {ranks.world} ranks" if shard else ""),
        )
        config = run_config(
            "train",
            mcfg,
            train=cfg,
            data=data_dirs,
            tokenizer=objective.tokenizer,
            seq_len=objective.seq_len,
            init_from=str(init_from) if init_from else None,
        )
        if ranks.enabled:
            config["data_parallel"] = parallel
        if sync is not None:
            config.update(sync=sync.to_dict(), centre=centre, centres=centres)
        # Checked before the folder is rewritten or the model built: a resume
        # with nothing left to do neither trains nor touches the run.
        if last is not None:
            run.check_same_model(config)
            diloco.check_resume(run, config)
            if (done := finished(run, last, cfg.steps)) is not None:
                return done
        # every centre keeps a folder of its own; of DDP's ranks, rank 0 alone
        main = ranks.is_main
        if main:
            run.start(config, resume=resume, tokenizer=objective.tokenizer_file)
        ctx.barrier()

        model = build_model(mcfg, seed=cfg.seed).to(device)
        if init_from:
            load_model_checkpoint(model, init_from)
        executor = LocalExecutor(
            model,
            list(model.named_parameters()),
            cfg,
            # a centre trains alone between outer steps: DDP inside it only
            ctx=ranks,
            checkpoint_fields={"model": mcfg.to_dict(), "train": cfg.to_dict()},
            parallel=parallel,
        )
        if sync is not None:
            executor = diloco.centre_executor(executor, sync, where, config)
        objective.start(device)
        regime = Regime(objective, executor, cfg, run)
        engine = Engine.for_config(
            run,
            cfg,
            desc=objective.desc,
            progress=progress,
            main=main,
            tensorboard=tensorboard,
        )
        start_step = engine.restore(regime, last, resume=resume)
        if sync is not None:
            start_step = diloco.admit(executor, objective, engine, start_step, joining)
        model.train()
        summary = engine.run(regime, range(start_step, cfg.steps))
        del summary["records"]
        return summary
    finally:
        # Also on an error: a process group left up aborts the process at exit.
        distributed.teardown(ctx)
        if unlabel is not None:
            unlabel()

"""``aisyn finetune``: supervised fine-tuning on cloze items from a base model.

A standalone or data-fusion run (one or several SFT folders pooled): the SFT
objective on the local executor, writing a run folder of ``"kind":
"finetune"`` so ``aisyn eval`` scores it in the ``prompt`` format it was
trained on. Checkpoints hold the merged weights that ``aisyn eval`` reads,
with the optimizer, RNG and (LoRA) the adapters, so ``--resume`` continues
exactly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch

from aisyn.train import checkpoint as ckpt
from aisyn.train import diloco, distributed
from aisyn.train.config import TrainConfig
from aisyn.train.device import autocast_on, resolve_device
from aisyn.train.diloco import DiLoCoConfig
from aisyn.train.engine import Engine, finished
from aisyn.train.executor import LocalExecutor
from aisyn.train.lora import Method, apply_method
from aisyn.train.memory import check_fits, whole_model_bytes
from aisyn.train.models import check_data_matches, describe_base, load_base
from aisyn.train.objective import SFTObjective
from aisyn.train.regime import Regime
from aisyn.train.run import TOKENIZER, RunDir, run_config
from aisyn.validate import read_json

#: the finished run's summary (what ``finetune`` returns)
SUMMARY = "summary.json"


def finetune(
    base: str | Path,
    data_dirs: Sequence[str | Path],
    out: str | Path,
    cfg: TrainConfig,
    method: Method | None = None,
    *,
    resume: bool = False,
    progress: bool = True,
    tensorboard: bool = False,
    sync: DiLoCoConfig | None = None,
    sync_timeout_s: float | None = None,
    parallel: str = "ddp",
) -> dict:
    """Fine-tune ``base`` on the pooled SFT folders; returns a summary dict.

    ``sync``: DiLoCo across torchrun's ranks, a centre each (or of
    ``ranks_per_centre``, DDP inside it, or FSDP2 with ``parallel="fsdp"``),
    as ``aisyn train --sync diloco`` (``train.diloco``; the outer step covers
    what the method trains: every weight, or LoRA's adapters).
    """
    method = method or Method()
    if parallel == "fsdp" and method.name == "lora":
        raise ValueError(
            "--data-parallel fsdp shards a full fine-tune; LoRA's adapters are "
            "small: drop it (DDP), or use --method full"
        )
    centre, shard = 0, None
    if sync is None and distributed.world_size() > 1:
        raise ValueError(
            "aisyn finetune under torchrun trains one centre per rank: give "
            "--sync diloco (it has no data-parallel mode)"
        )
    if sync is not None:
        world, rank = distributed.world_size(), distributed.rank()
        cfg, data_dirs = diloco.centre_settings(cfg, sync, world, rank, data_dirs)
        centre, centres = diloco.centre_of(rank, world, sync.ranks_per_centre)
        per = sync.ranks_per_centre
        if parallel == "fsdp" and per > 1:
            shard = (rank % per, per)  # this rank's FSDP2 shards in its centre
    device = resolve_device(cfg.device)
    info = describe_base(base)
    objective = SFTObjective(data_dirs, cfg)
    check_data_matches(info, objective.sources)
    check_fits(
        whole_model_bytes(
            info.model,
            cfg.micro * (shard[1] if shard else 1),
            objective.seq_len,
            autocast=autocast_on(device, cfg.autocast),
            activation_checkpointing=cfg.activation_checkpointing,
            # LoRA keeps no gradients or optimizer state for the frozen weights
            trains_all_weights=method.name != "lora",
            shard=shard,
        ),
        device,
        f"fine-tuning with micro-batches of {cfg.micro}"
        + (f", FSDP2 over {shard[1]} ranks" if shard else ""),
    )
    run = RunDir(diloco.centre_folder(out, centre))
    config = run_config(
        "finetune",
        info.model,
        train=cfg,
        method=method.to_dict(),
        data=data_dirs,
        tokenizer=info.tokenizer,
        seq_len=objective.seq_len,
        base=info.to_dict(),
    )
    ctx = ranks = distributed.DistContext()
    unlabel = None
    if sync is not None:
        config.update(sync=sync.to_dict(), centre=centre, centres=centres)
        # each centre's log lines say whose they are
        unlabel = diloco.label_logs(diloco.centre_label(rank, sync.ranks_per_centre))
        if sync.ranks_per_centre > 1:
            config["data_parallel"] = parallel
        timeout = None if sync_timeout_s is None else timedelta(seconds=sync_timeout_s)
        try:
            ctx, device = distributed.setup(device, timeout)
        except BaseException:
            unlabel()
            raise
    try:
        last = ckpt.latest(run.checkpoints) if resume else None
        if sync is not None:
            # a centre of several ranks runs DDP (or FSDP2) inside it
            where = diloco.topology(ctx, sync.ranks_per_centre)
            ranks = where.inner
            joining = diloco.joining_centres(run, where, resume=resume)
            last = diloco.agreed_checkpoint(run, last, where, joining, cfg.steps)
        if last is not None:
            run.check_same_model(config)
            diloco.check_resume(run, config)
            check_same_start(run, config)
            if (done := finished(run, last, cfg.steps)) is not None:
                summary = run.path / SUMMARY
                return read_json(summary) if summary.is_file() else done
        if ranks.is_main:  # a centre's rank 0 alone writes its folder
            run.start(config, resume=resume, tokenizer=info.path / TOKENIZER)
        ranks.barrier()
        torch.manual_seed(cfg.seed)
        model, _ = load_base(info, device)
        trainable = apply_method(model, method, seed=cfg.seed)
        executor = LocalExecutor(
            model,
            trainable,
            cfg,
            method=method,
            ctx=ranks,
            checkpoint_fields={"method": method.to_dict()},
            hint=" (lower the learning rate?)",
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
            main=ranks.is_main,
            tensorboard=tensorboard,
        )
        start_step = engine.restore(regime, last, resume=resume)
        if sync is not None:
            start_step = diloco.admit(executor, objective, engine, start_step, joining)
        result = engine.run(regime, range(start_step, cfg.steps))
    finally:
        distributed.teardown(ctx)
        if unlabel is not None:
            unlabel()
    summary = {
        "run": str(run.path),
        "steps": cfg.steps,
        "epochs": round(objective.batches.epoch_float, 4),
        "final_loss": result["final_loss"],
        "elapsed_s": result["elapsed_s"],
        "trainable_parameters": sum(p.numel() for _, p in trainable),
        "plot": result["plot"],
    }
    if ranks.is_main:
        (run.path / SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary


def check_same_start(run: RunDir, config: dict) -> None:
    """Refuse to resume a fine-tuning run with another method or base than it
    started with, before its folder is touched: its checkpoint holds the
    optimizer (and adapters) of that method, trained on that base."""
    old = run.read_config()
    if old.get("method") != config["method"]:
        was = Method.from_dict(old.get("method") or {})
        raise ValueError(
            f"{run.path}: fine-tuned with --method {was.name} (rank {was.rank}, "
            f"alpha {was.alpha:g}); resume it with the same --method, --lora-rank "
            "and --lora-alpha"
        )
    was = (old.get("base") or {}).get("fingerprint")
    now = config["base"]["fingerprint"]
    if was != now:
        raise ValueError(
            f"{run.path}: fine-tuned from base {str(was)[:12]}, but --base "
            f"{config['base']['path']} is {now[:12]}; resume it from the same base"
        )

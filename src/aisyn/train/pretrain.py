"""``aisyn train``: language-model pre-training of the whole model here.

The language-model objective on the local executor, single-process or
data-parallel under ``torchrun``; the plain baseline that split training
must match to 1e-5.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from aisyn.model.families import ModelConfig, build_model, hf_folder
from aisyn.train import checkpoint as ckpt
from aisyn.train import distributed
from aisyn.train.config import TrainConfig, per_rank_micro_batches
from aisyn.train.device import autocast_on, resolve_device
from aisyn.train.engine import Engine, finished
from aisyn.train.executor import LocalExecutor
from aisyn.train.memory import check_fits, whole_model_bytes
from aisyn.train.models import load_model_checkpoint, model_config_for
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
) -> dict:
    """Train from scratch (or ``init_from`` a checkpoint) and write a run folder.

    Returns a summary: final loss, steps, tokens, elapsed seconds, run path.
    """
    cfg = per_rank_micro_batches(cfg, distributed.world_size())
    objective = LMObjective(data_dirs, cfg)
    mcfg = model_config_for(model_config, objective.tokenizer, objective.seq_len)
    if init_from is None and isinstance(model_config, str | Path):
        if hf_folder(model_config) is not None:
            init_from = model_config  # a pretrained folder brings its weights
    run = RunDir(out)
    last = ckpt.latest(run.checkpoints) if resume else None
    ctx, device = distributed.setup(resolve_device(cfg.device))
    check_fits(
        whole_model_bytes(
            mcfg,
            cfg.micro,
            objective.seq_len,
            autocast=autocast_on(device, cfg.autocast),
            activation_checkpointing=cfg.activation_checkpointing,
        ),
        device,
        f"training with micro-batches of {cfg.micro}",
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
    # Checked before the folder is rewritten or the model built: a resume
    # with nothing left to do neither trains nor touches the run.
    if last is not None:
        run.check_same_model(config)
        if (done := finished(run, last, cfg.steps)) is not None:
            distributed.teardown(ctx)
            return done
    if ctx.is_main:
        run.start(config, resume=resume, tokenizer=objective.tokenizer_file)
    ctx.barrier()

    model = build_model(mcfg, seed=cfg.seed).to(device)
    if init_from:
        load_model_checkpoint(model, init_from)
    executor = LocalExecutor(
        model,
        list(model.named_parameters()),
        cfg,
        ctx=ctx,
        checkpoint_fields={"model": mcfg.to_dict(), "train": cfg.to_dict()},
    )
    objective.start(device)
    regime = Regime(objective, executor, cfg, run)
    engine = Engine.for_config(
        run,
        cfg,
        desc=objective.desc,
        progress=progress,
        main=ctx.is_main,
        tensorboard=tensorboard,
    )
    start_step = engine.restore(regime, last, resume=resume)
    model.train()
    try:
        summary = engine.run(regime, range(start_step, cfg.steps))
    finally:
        distributed.teardown(ctx)
    del summary["records"]
    return summary

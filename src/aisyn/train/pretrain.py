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
from pathlib import Path

from aisyn.model.families import ModelConfig, build_model, hf_folder
from aisyn.train.config import TrainConfig
from aisyn.train.job import Job
from aisyn.train.models import (
    check_base_tokenizer,
    load_model_checkpoint,
    model_config_for,
)
from aisyn.train.objective import LMObjective
from aisyn.train.run import run_config


def train(
    model_config: ModelConfig | str,
    data_dirs: Sequence[str | Path],
    out: str | Path,
    cfg: TrainConfig,
    *,
    init_from: str | Path | None = None,
    **job_options,
) -> dict:
    """Train from scratch (or ``init_from`` a checkpoint) and write a run folder.

    Returns a summary: final loss, steps, tokens, elapsed seconds, run path.
    ``job_options``: the ``train.job.Job``'s -- ``resume``, ``progress``,
    ``tensorboard``; ``parallel``: ``ddp`` or ``fsdp`` (FSDP2, ``train.fsdp``)
    over the ranks of the job, or of a centre; ``sync``: DiLoCo across
    torchrun's ranks, a centre each, or centres of ``sync.ranks_per_centre``
    ranks (``sync_timeout_s``: how long a centre waits for the others).
    """
    job = Job(Path(out), cfg, data_dirs, **job_options)
    with job.place() as at:
        objective = LMObjective(at.data, at.cfg)
        mcfg = model_config_for(
            model_config, objective.tokenizer, objective.seq_len, at.data
        )
        if init_from is None and isinstance(model_config, str | Path):
            if hf_folder(model_config) is not None:
                init_from = model_config  # a pretrained folder brings its weights
        elif init_from is not None and hf_folder(init_from) is not None:
            check_base_tokenizer(init_from, objective.tokenizer, at.data[0])
        at.check_memory(mcfg, objective.seq_len, "training")
        config = at.record(
            run_config(
                "train",
                mcfg,
                train=at.cfg,
                data=at.data,
                tokenizer=objective.tokenizer,
                seq_len=objective.seq_len,
                init_from=str(init_from) if init_from else None,
            )
        )
        if (done := at.resume(config)) is not None:
            return done
        at.start(config, objective.tokenizer_file)
        model = build_model(mcfg, seed=at.cfg.seed).to(at.device)
        if init_from:
            load_model_checkpoint(model, init_from)
        executor = at.executor(
            model,
            list(model.named_parameters()),
            config,
            checkpoint_fields={"model": mcfg.to_dict(), "train": at.cfg.to_dict()},
        )
        model.train()
        return at.train(objective, executor)

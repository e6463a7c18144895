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
from pathlib import Path

import torch

from aisyn.train import distributed
from aisyn.train.config import TrainConfig
from aisyn.train.job import Job
from aisyn.train.lora import Method, apply_method
from aisyn.train.models import check_data_matches, describe_base, load_base
from aisyn.train.objective import SFTObjective
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
    **job_options,
) -> dict:
    """Fine-tune ``base`` on the pooled SFT folders; returns a summary dict.

    ``job_options``: the ``train.job.Job``'s (resume, progress, tensorboard,
    parallel, sync, sync_timeout_s). ``sync``: DiLoCo across torchrun's ranks,
    a centre each (or of ``ranks_per_centre``, DDP inside it, or FSDP2 with
    ``parallel="fsdp"``), as ``aisyn train --sync diloco`` (``train.diloco``;
    the outer step covers what the method trains: every weight, or LoRA's
    adapters).
    """
    method = method or Method()
    job = Job(Path(out), cfg, data_dirs, **job_options)
    if job.parallel == "fsdp" and method.name == "lora":
        raise ValueError(
            "--data-parallel fsdp shards a full fine-tune; LoRA's adapters are "
            "small: drop it (DDP), or use --method full"
        )
    if job.sync is None and distributed.world_size() > 1:
        raise ValueError(
            "aisyn finetune under torchrun trains one centre per rank: give "
            "--sync diloco (it has no data-parallel mode)"
        )
    info = describe_base(base)
    with job.place() as at:
        objective = SFTObjective(at.data, at.cfg)
        check_data_matches(info, objective.sources)
        at.check_memory(
            info.model,
            objective.seq_len,
            "fine-tuning",
            # LoRA keeps no gradients or optimizer state for the frozen weights
            trains_all_weights=method.name != "lora",
        )
        config = at.record(
            run_config(
                "finetune",
                info.model,
                train=at.cfg,
                method=method.to_dict(),
                data=at.data,
                tokenizer=info.tokenizer,
                seq_len=objective.seq_len,
                base=info.to_dict(),
            )
        )
        if (done := at.resume(config, [check_same_start])) is not None:
            summary = at.run.path / SUMMARY
            return read_json(summary) if summary.is_file() else done
        at.start(config, info.path / TOKENIZER)
        torch.manual_seed(at.cfg.seed)
        model, _ = load_base(info, at.device)
        trainable = apply_method(model, method, seed=at.cfg.seed)
        executor = at.executor(
            model,
            trainable,
            config,
            method=method,
            checkpoint_fields={"method": method.to_dict()},
            hint=" (lower the learning rate?)",
        )
        result = at.train(objective, executor)
    summary = {
        "run": str(at.run.path),
        "steps": at.cfg.steps,
        "epochs": round(objective.batches.epoch_float, 4),
        "final_loss": result["final_loss"],
        "elapsed_s": result["elapsed_s"],
        "trainable_parameters": sum(p.numel() for _, p in trainable),
        "plot": result["plot"],
    }
    if at.ranks.is_main:
        (at.run.path / SUMMARY).write_text(json.dumps(summary, indent=2))
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

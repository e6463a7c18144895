"""What every node of a federation (the server, ``fl.server``, and each client,
``fl.client``) builds alike from the run's settings: the base model with the
fine-tuning method applied, and its run folder's ``config.json``.

One function each, so that the two ends agree by construction: the same seed
and method give the same trainable tensors (their names and shapes are the
``spec`` every message is checked against), and every run folder records the
settings and the base the same way (a resumed node compares them).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from aisyn.fl.settings import FLSettings
from aisyn.train.lora import apply_method
from aisyn.train.models import BaseModel, load_base
from aisyn.train.run import TOKENIZER, RunDir, run_config


def build_trainable(
    info: BaseModel, settings: FLSettings, device: str | torch.device
) -> tuple[nn.Module, list[tuple[str, nn.Parameter]], dict[str, tuple[int, ...]]]:
    """The base model on ``device`` with the run's method applied (the torch
    seed set to the run's first), its trainable (name, parameter)s and their
    shapes by name."""
    torch.manual_seed(settings.train.seed)
    model, _ = load_base(info, device)
    trainable = apply_method(model, settings.method_spec(), settings.train.seed)
    return model, trainable, {n: tuple(p.shape) for n, p in trainable}


def start_run(
    run: RunDir,
    settings: FLSettings,
    info: BaseModel,
    *,
    role: str,
    seq_len: int,
    resume: bool = False,
    data: Sequence[str | Path] = (),
    **extra,
) -> None:
    """Start (or, with ``resume``, reopen) a node's run folder: a fine-tuning
    run of ``info`` under ``settings``, as ``role``, with what the node adds
    (a client's ``data`` folder, ``extra``: its name)."""
    run.start(
        run_config(
            "finetune",
            info.model,
            role=role,
            **extra,
            method=settings.method_spec().to_dict(),
            federated=settings.to_dict(),
            data=data,
            tokenizer=info.tokenizer,
            seq_len=seq_len,
            base=info.to_dict(),
        ),
        resume=resume,
        tokenizer=info.path / TOKENIZER,
    )

"""The optimizer every regime and every party builds: one AdamW recipe."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from aisyn.train.config import TrainConfig


def make_optimizer(
    named_params: Sequence[tuple[str, nn.Parameter]], cfg: TrainConfig
) -> torch.optim.AdamW:
    """AdamW, β=(0.9, 0.95); no weight decay on biases and LayerNorm gains.

    Per-parameter, so each party of a split run can own the optimizer of just its
    own parameters and the update is the same as the unsplit one.
    """
    decay = [p for _, p in named_params if p.requires_grad and p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )

"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr``.

A pure function of the step, so resuming needs no scheduler state and every
party of a split run computes the same rate independently.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Rate for optimizer step ``step`` (0-based) of ``total``."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))

"""The data party's private warm-up: training on its own text, alone, before
any activation leaves it.

Every white-box attack on the cut, and every learned inverter B fits on
public text, runs A's front as B believes it is: the public base's. A run
that starts from the base sends, in its first steps, exactly the base's
activations of A's text. ``--private-warmup STEPS`` (ADMI, arXiv 2606.14210,
warms the owner's part up privately for the same reason) first trains A's
own blocks and head locally on A's data, through the emulator of B's middle
(``split.defence.emulator``) in B's place, so that the front A then runs in the
session has already drifted from the public weights where A's text pulled
it. Nothing of the warm-up crosses: B is not even connected yet, and A's
weights never are sent.

The warm-up has an optimizer of its own (dropped afterwards: the run's
starts fresh, as from any base) and draws its batches from a stream of
their own (the run's data order is the one it would have had without it).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from aisyn.split.party import PartyState
from aisyn.train.config import TrainConfig
from aisyn.train.device import autocast_for
from aisyn.train.objective import Objective
from aisyn.train.optim import make_optimizer

log = logging.getLogger(__name__)

#: the warm-up's batches come from the run's data under another seed
SEED_OFFSET = 0x5EED


def private_warmup(
    state: PartyState,
    emulator: nn.Module,
    new_objective: Callable[[TrainConfig], Objective],
    steps: int,
) -> dict:
    """Train ``state``'s blocks and head for ``steps`` steps on A's data
    (``new_objective(cfg)``: the run's objective under a warm-up seed) with
    ``emulator`` in B's place; returns the record (losses at start and end)."""
    cfg = state.train_cfg
    front, back = state.segments
    wcfg = replace(cfg, seed=(cfg.seed + SEED_OFFSET) % (2**63))
    objective = new_objective(wcfg)
    objective.start(state.device)
    optimizer = make_optimizer(state.named, cfg)
    params = [p for _, p in state.named if p.requires_grad]
    warm = max(1, min(cfg.warmup_steps, steps // 10))
    state.train(True)
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        batch = objective.next_step(cfg.batch_size)
        total = 0.0
        for inputs, targets, mask, pos in batch.micro:
            with autocast_for(state.device, cfg.autocast):
                hidden = back(emulator(front(inputs, mask, pos), mask, pos), mask, pos)
                loss = batch.loss_of(back.logits, hidden, targets)
            loss.backward()
            total += loss.item()
        if not math.isfinite(total):
            raise FloatingPointError(
                f"--private-warmup: non-finite loss ({total}) at warm-up step "
                f"{step} (lower --lr?)"
            )
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / warm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    record = {
        "steps": steps,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "elapsed_s": round(time.perf_counter() - t0, 2),
    }
    log.info(
        "private warm-up: %d steps on this party's own data, loss %.4f -> %.4f "
        "(%.1f s); nothing crossed",
        steps,
        losses[0],
        losses[-1],
        record["elapsed_s"],
    )
    return record

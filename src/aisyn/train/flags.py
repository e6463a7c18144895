"""The training flags of every command that trains (``aisyn train``, ``aisyn
split train``, ``aisyn finetune``) and the ``TrainConfig`` they make.

Here, below the commands, so that each command's parser imports them from one
place instead of from another command's module.
"""

from __future__ import annotations

import argparse

from aisyn import validate
from aisyn.flagtable import DEVICE, add_flags
from aisyn.train.loop import TrainConfig
from aisyn.validate import nonneg_float, nonneg_int, positive_float, positive_int


def add_train_args(
    p: argparse.ArgumentParser, steps: int = 200, *, resumable: bool = True
) -> None:
    """Training flags shared by ``train``, ``split train`` and fine-tuning
    (``resumable=False``: no ``--resume``, for a command that cannot)."""
    g = p.add_argument_group("training")
    add_flags(
        g,
        ("--steps", positive_int, steps, "optimizer steps"),
        ("--batch-size", positive_int, 8, "samples per optimizer step"),
        (
            "--micro-batch-size",
            positive_int,
            None,
            "samples per forward/backward (gradient accumulation)",
        ),
        ("--lr", positive_float, 1e-3, "peak learning rate"),
        (
            "--min-lr",
            nonneg_float,
            None,
            "final learning rate of the cosine decay (default lr/10)",
        ),
        ("--warmup", nonneg_int, 20, "linear warm-up steps"),
        (
            "--weight-decay",
            nonneg_float,
            0.1,
            "AdamW weight decay (not on biases and norms)",
        ),
        ("--grad-clip", nonneg_float, 1.0, "clip the global gradient L2 norm (0: off)"),
        ("--seed", validate.seed, 1234, "seed of the initial weights and data order"),
        ("--log-every", positive_int, 10, "log and record metrics every N steps"),
        (
            "--ckpt-every",
            nonneg_int,
            0,
            "checkpoint every N steps (0: only at the end)",
        ),
        ("--eval-every", nonneg_int, 0, "validation loss every N steps (0: never)"),
        (
            "--eod-reset",
            "store_true",
            None,
            "reset attention and positions at each end of document",
        ),
        DEVICE,
        (
            "--tensorboard",
            "store_true",
            None,
            "also write TensorBoard event files to OUT/tensorboard",
        ),
    )
    if resumable:
        g.add_argument(
            "--resume",
            action="store_true",
            help="continue the run in --out from its latest checkpoint (the "
            "folder must hold a run)",
        )


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of the flags ``add_train_args`` added."""
    return TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        lr=args.lr,
        min_lr=args.min_lr,
        warmup_steps=args.warmup,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        seed=args.seed,
        log_every=args.log_every,
        ckpt_every=args.ckpt_every,
        eval_every=args.eval_every,
        eod_reset=args.eod_reset,
        device=args.device,
    )

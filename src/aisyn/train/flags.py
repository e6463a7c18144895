"""The training flags of every command that trains (``aisyn train``, ``aisyn
split train``, ``aisyn finetune``) and the ``TrainConfig`` they make.

Here, below the commands, so that each command's parser imports them from one
place instead of from another command's module.
"""

from __future__ import annotations

import argparse

from aisyn import validate
from aisyn.train.loop import TrainConfig


def add_train_args(
    p: argparse.ArgumentParser, steps: int = 200, *, resumable: bool = True
) -> None:
    """Training flags shared by ``train``, ``split train`` and fine-tuning
    (``resumable=False``: no ``--resume``, for a command that cannot)."""
    g = p.add_argument_group("training")
    g.add_argument(
        "--steps", type=validate.positive_int, default=steps, help="optimizer steps"
    )
    g.add_argument(
        "--batch-size",
        type=validate.positive_int,
        default=8,
        help="samples per optimizer step",
    )
    g.add_argument(
        "--micro-batch-size",
        type=validate.positive_int,
        default=None,
        help="samples per forward/backward (gradient accumulation)",
    )
    g.add_argument(
        "--lr", type=validate.positive_float, default=1e-3, help="peak learning rate"
    )
    g.add_argument(
        "--min-lr",
        type=validate.nonneg_float,
        default=None,
        help="final learning rate of the cosine decay (default lr/10)",
    )
    g.add_argument(
        "--warmup", type=validate.nonneg_int, default=20, help="linear warm-up steps"
    )
    g.add_argument("--weight-decay", type=validate.nonneg_float, default=0.1)
    g.add_argument(
        "--grad-clip",
        type=validate.nonneg_float,
        default=1.0,
        help="clip the global gradient L2 norm (0: off)",
    )
    g.add_argument("--seed", type=validate.nonneg_int, default=1234)
    g.add_argument("--log-every", type=validate.positive_int, default=10)
    g.add_argument(
        "--ckpt-every",
        type=validate.nonneg_int,
        default=0,
        help="checkpoint every N steps (0: only at the end)",
    )
    g.add_argument(
        "--eval-every",
        type=validate.nonneg_int,
        default=0,
        help="validation loss every N steps (0: never)",
    )
    g.add_argument(
        "--eod-reset",
        action="store_true",
        help="reset attention and positions at each end of document",
    )
    g.add_argument(
        "--device",
        type=validate.device,
        default="auto",
        help="auto, cpu, cuda, cuda:1, ...",
    )
    g.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write TensorBoard event files to OUT/tensorboard",
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

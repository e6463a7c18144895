"""The training flags of every command that trains (``aisyn train``, ``aisyn
split train``, ``aisyn finetune``) and the ``TrainConfig`` they make.

Derived from ``TrainConfig``'s declarations (``train.config.setting``): each
field with a flag becomes one option with the field's default and its range as
the argparse type, so a default or a bound is written once.
"""

from __future__ import annotations

import argparse

from aisyn import validate
from aisyn.flagtable import DEVICE, Row, add_flags
from aisyn.setting import flag_rows, from_args
from aisyn.train.config import TrainConfig
from aisyn.train.diloco.config import DiLoCoConfig
from aisyn.train.lora import Method

#: ``--resume auto``: continue the run if the folder holds one, else start it
AUTO = "auto"


def _resume_mode(value: str) -> str:
    if value != AUTO:
        raise argparse.ArgumentTypeError(
            f"--resume takes no value or '{AUTO}', got {value!r}"
        )
    return value


#: the LoRA flags of every command that fine-tunes (with its own --method)
LORA_FLAGS = (
    Row("--lora-rank", validate.positive_int, Method.rank, "rank of the LoRA adapters"),
    Row(
        "--lora-alpha",
        validate.positive_float,
        Method.alpha,
        "LoRA scale alpha (delta = alpha/rank BA)",
    ),
)


def add_train_args(
    p: argparse.ArgumentParser, steps: int = 200, *, resumable: bool = True
) -> None:
    """Training flags shared by ``train``, ``split train`` and fine-tuning
    (``resumable=False``: no ``--resume``, for a command that cannot)."""
    g = p.add_argument_group("training")
    add_flags(
        g,
        *flag_rows(TrainConfig, steps=steps),
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
            nargs="?",
            const=True,
            default=False,
            type=_resume_mode,
            metavar="auto",
            help="continue the run in --out from its latest checkpoint (the "
            "folder must hold a run); '--resume auto': if it holds one, else "
            "start it (for a job its launcher restarts: torchrun "
            "--max-restarts)",
        )


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of the flags ``add_train_args`` added."""
    return from_args(TrainConfig, args, device=args.device)


def print_summary(summary: dict, details: str) -> None:
    """A training command's last two lines (scripts read them): the final loss
    after its steps, then ``details``; its run folder and loss plot."""
    print(
        f"final loss {summary['final_loss']:.4f} after {summary['steps']} steps "
        + details
    )
    print(f"run folder: {summary['run']}  loss plot: {summary['plot']}")


#: the cross-centre synchronisation flags of ``aisyn train`` (``train.diloco``)
DATA_PARALLEL = Row(
    "--data-parallel",
    ["ddp", "fsdp"],
    "ddp",
    "under torchrun (and inside a --sync diloco centre): ddp keeps a replica "
    "of the model on every rank; fsdp shards its weights, gradients and AdamW "
    "state over them (FSDP2), for a model one device cannot hold",
)

SYNC_FLAGS = (
    Row(
        "--sync",
        ["ddp", "diloco"],
        "ddp",
        "under torchrun: ddp (every step's gradients all-reduced) or diloco "
        "(each rank a centre training alone, the centres meeting every "
        "--inner-steps steps: for a wide-area link)",
    ),
    *flag_rows(DiLoCoConfig),
    Row(
        "--sync-timeout",
        validate.positive_float,
        1800.0,
        "diloco: seconds a centre waits for the others at an outer step",
    ),
)


def sync_from_args(args: argparse.Namespace) -> DiLoCoConfig | None:
    """The ``DiLoCoConfig`` of ``SYNC_FLAGS`` (None: DDP)."""
    return from_args(DiLoCoConfig, args) if args.sync == "diloco" else None


def job_from_args(args: argparse.Namespace) -> dict:
    """What the flags say of a run of ``aisyn train`` or ``aisyn finetune``
    besides its model and data: the keywords of ``train`` and ``finetune``
    (resume, progress bar, TensorBoard, DiLoCo and its timeout, DDP or FSDP2)."""
    sync = sync_from_args(args)
    return dict(
        resume=resume_from_args(args, sync),
        progress=not args.quiet,
        tensorboard=args.tensorboard,
        sync=sync,
        sync_timeout_s=args.sync_timeout if sync is not None else None,
        parallel=args.data_parallel,
    )


def resume_from_args(args: argparse.Namespace, sync) -> bool:
    """Whether to continue the run in this rank's folder: ``--resume``,
    refused in one line when the folder holds no run; ``--resume auto``,
    when it holds one. A DiLoCo centre's folder (``centres/<k>`` beyond the
    first) is checked once the centres have met, all of them alike
    (``diloco.joining_centres``)."""
    if not args.resume:
        return False
    folder = args.out
    if sync is not None:
        from aisyn.train import distributed
        from aisyn.train.diloco import centre_folder, centre_of

        rank, world = distributed.rank(), distributed.world_size()
        centre, _ = centre_of(rank, world, sync.ranks_per_centre)
        folder = centre_folder(args.out, centre)
    if args.resume == AUTO:
        return validate.holds_run(folder)
    if sync is None:
        validate.check_resumable(folder)
    return True

"""The training flags of every command that trains (``aisyn train``, ``aisyn
split train``, ``aisyn finetune``) and the ``TrainConfig`` they make.

Derived from ``TrainConfig``'s declarations (``train.config.setting``): each
field with a flag becomes one option with the field's default and its range as
the argparse type, so a default or a bound is written once.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from aisyn import validate
from aisyn.flagtable import DEVICE, Row, add_flags
from aisyn.train.config import TrainConfig
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

#: the argparse types of the ranges TrainConfig's fields have
_TYPES = {
    ("int", (("low", 1),)): validate.positive_int,
    ("int", (("low", 0),)): validate.nonneg_int,
    ("float", (("low", 0), ("low_open", True))): validate.positive_float,
    ("float", (("low", 0),)): validate.nonneg_float,
    ("int", tuple(validate.SEED_RANGE.items())): validate.seed,
}


def _flag_type(f):
    """The argparse type (or action) of a field: its range, as a flag."""
    if isinstance(f.default, bool):
        return "store_true"
    if f.metadata["choices"]:
        return list(f.metadata["choices"])
    kind = "int" if f.type in ("int", "int | None") else "float"
    return _TYPES[kind, tuple(f.metadata["bounds"].items())]


#: (field, flag) of every TrainConfig field set on the command line
FLAGGED = [(f, f.metadata["flag"]) for f in fields(TrainConfig) if f.metadata["flag"]]


def add_train_args(
    p: argparse.ArgumentParser, steps: int = 200, *, resumable: bool = True
) -> None:
    """Training flags shared by ``train``, ``split train`` and fine-tuning
    (``resumable=False``: no ``--resume``, for a command that cannot)."""
    g = p.add_argument_group("training")
    rows = [
        (
            flag,
            _flag_type(f),
            steps if f.name == "steps" else (None if f.default is False else f.default),
            f.metadata["help"],
        )
        for f, flag in FLAGGED
    ]
    add_flags(
        g,
        *rows,
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
    return TrainConfig(
        **{f.name: getattr(args, flag[2:].replace("-", "_")) for f, flag in FLAGGED},
        device=args.device,
    )


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
    Row(
        "--ranks-per-centre",
        validate.positive_int,
        1,
        "diloco: torchrun's ranks per centre (a node's, say), contiguous: DDP "
        "inside a centre, the outer step across centres",
    ),
    Row(
        "--inner-steps",
        validate.positive_int,
        100,
        "diloco: each centre's own steps between outer steps (H)",
    ),
    Row(
        "--outer-lr",
        validate.positive_float,
        0.7,
        "diloco: the outer SGD's learning rate",
    ),
    Row(
        "--outer-momentum",
        validate.nonneg_float,
        0.9,
        "diloco: the outer SGD's Nesterov momentum (0: none)",
    ),
    Row(
        "--delta-precision",
        ["fp32", "bf16", "fp16", "int8"],
        "fp32",
        "diloco: what the centres' deltas cross as (int8: a scale per 4096 values)",
    ),
    Row(
        "--centre-data",
        ["split", "own"],
        "split",
        "diloco: split: every centre reads its share of every batch of the "
        "same --data (as DDP's ranks); own: centre i reads the i-th --data alone",
    ),
    Row(
        "--fragments",
        validate.positive_int,
        1,
        "diloco: Streaming DiLoCo: the model in this many fragments, each "
        "exchanged every H steps, H/fragments steps apart (a fragment's bytes "
        "at a time)",
    ),
    Row(
        "--overlap-steps",
        validate.nonneg_int,
        0,
        "diloco: inner steps a fragment's exchange overlaps (< H/fragments): it "
        "crosses while the centre trains on",
    ),
    Row(
        "--overlap-mixing",
        validate.nonneg_float,
        0.5,
        "diloco, with --overlap-steps: the local model's share of a fragment "
        "after its exchange (the rest: the new global model)",
    ),
    Row(
        "--delta-bound",
        validate.positive_float,
        4.0,
        "diloco: a centre's delta is left out when its norm is above this many "
        "times the other centres' median (or, with no fair other, its own last "
        "accepted norm) (> 1)",
    ),
    Row(
        "--delta-min-cosine",
        validate.number_type(float, "cosine", low=-1, high=1),
        -0.5,
        "diloco: a centre's delta is left out when its cosine to the run's "
        "recent direction (the outer momentum) is below this (-1 to 1)",
    ),
    Row(
        "--sync-timeout",
        validate.positive_float,
        1800.0,
        "diloco: seconds a centre waits for the others at an outer step",
    ),
)


def sync_from_args(args: argparse.Namespace):
    """The ``DiLoCoConfig`` of ``SYNC_FLAGS`` (None: DDP)."""
    if args.sync != "diloco":
        return None
    from aisyn.train.diloco import DiLoCoConfig

    return DiLoCoConfig(
        inner_steps=args.inner_steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        precision=args.delta_precision,
        data=args.centre_data,
        ranks_per_centre=args.ranks_per_centre,
        fragments=args.fragments,
        overlap_steps=args.overlap_steps,
        mixing=args.overlap_mixing,
        delta_bound=args.delta_bound,
        delta_min_cosine=args.delta_min_cosine,
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

"""``TrainConfig``: how a run trains, whatever it trains and wherever it runs.

Each field is declared once, with its default, its range and -- for those a
user sets on the command line -- its flag and help text. The flags of every
command that trains (``train.flags``), the range checks of a config read from a
run folder, a federated TOML file or a peer's hello (``__post_init__``), and the
federated settings' local-training keys (``fl.settings``) are all derived from
these declarations, so a default or a bound is changed in one place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from aisyn.setting import check_fields, setting
from aisyn.train.schedule import lr_at
from aisyn.validate import SEED_RANGE

#: ``--autocast``: bf16 on CUDA only, everywhere (CPU too), or nowhere
AUTOCAST_MODES = ("auto", "bf16", "off")


@dataclass
class TrainConfig:
    """Run-level training settings (the model's shape lives in ``ModelConfig``)."""

    steps: int = setting(200, "--steps", "optimizer steps", low=1)
    batch_size: int = setting(8, "--batch-size", "samples per optimizer step", low=1)
    micro_batch_size: int | None = setting(  # None: no gradient accumulation
        None,
        "--micro-batch-size",
        "samples per forward/backward (gradient accumulation)",
        low=1,
    )
    lr: float = setting(1e-3, "--lr", "peak learning rate", low=0, low_open=True)
    min_lr: float | None = setting(  # None: lr / 10
        None,
        "--min-lr",
        "final learning rate of the cosine decay (default lr/10)",
        low=0,
    )
    warmup_steps: int = setting(20, "--warmup", "linear warm-up steps", low=0)
    weight_decay: float = setting(
        0.1, "--weight-decay", "AdamW weight decay (not on biases and norms)", low=0
    )
    grad_clip: float = setting(  # global L2 norm; 0 disables
        1.0, "--grad-clip", "clip the global gradient L2 norm (0: off)", low=0
    )
    seed: int = setting(
        1234, "--seed", "seed of the initial weights and data order", **SEED_RANGE
    )
    log_every: int = setting(
        10, "--log-every", "log and record metrics every N steps", low=1
    )
    ckpt_every: int = setting(  # 0: only at the end
        0, "--ckpt-every", "checkpoint every N steps (0: only at the end)", low=0
    )
    keep_checkpoints: int = setting(2, low=1)
    eval_every: int = setting(  # 0: no validation during training
        0, "--eval-every", "validation loss every N steps (0: never)", low=0
    )
    eval_batches: int = setting(8, low=1)
    eod_reset: bool = setting(  # reset attention/positions at each EOD
        False, "--eod-reset", "reset attention and positions at each end of document"
    )
    # its flag is every command's (``flagtable``); checked where it is used
    # (``resolve_device``): a config from a run folder or a peer may name a
    # device this machine does not have
    device: str = setting("auto", check=False)
    autocast: str = setting(
        "auto",
        "--autocast",
        "bf16 autocast over fp32 master weights: auto (on CUDA only), bf16 "
        "(CPU too), off",
        choices=AUTOCAST_MODES,
    )
    activation_checkpointing: bool = setting(
        False,
        "--activation-checkpointing",
        "keep only each block's input and recompute the rest in backward "
        "(less memory, about 1/3 more compute)",
    )

    def __post_init__(self) -> None:
        # Range checks here, not only on flags: a TrainConfig also comes from
        # run folders, federated TOML files and the data party's hello.
        check_fields(self, lambda f: f.name)
        mb = self.micro
        if self.batch_size % mb:
            raise ValueError(
                f"micro_batch_size {mb} must divide batch_size {self.batch_size}"
            )

    @property
    def micro(self) -> int:
        return self.micro_batch_size or self.batch_size

    @property
    def grad_accum(self) -> int:
        return self.batch_size // self.micro

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def lr_at(self, step: int) -> float:
        return lr_at(
            step,
            lr=self.lr,
            min_lr=self.final_lr,
            warmup=self.warmup_steps,
            total=self.steps,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


#: every field's declaration, by name
SETTINGS = {f.name: f for f in fields(TrainConfig)}


def per_rank_micro_batches(cfg: TrainConfig, world: int) -> TrainConfig:
    """``cfg`` for ``world`` data-parallel ranks, each taking an equal share
    of every batch; ValueError, naming the flag to change, if it cannot.

    Without ``--micro-batch-size`` a rank's micro-batch is its whole share
    (no accumulation), so the defaults work at any world size that divides
    ``--batch-size``.
    """
    if world <= 1:
        return cfg
    if cfg.batch_size % world:
        raise ValueError(
            f"--batch-size {cfg.batch_size} does not split into {world} ranks: "
            f"give a --batch-size that is a multiple of {world}"
        )
    share = cfg.batch_size // world
    if cfg.micro_batch_size is None:
        return replace(cfg, micro_batch_size=share)
    if share % cfg.micro_batch_size:
        raise ValueError(
            f"--batch-size {cfg.batch_size} over {world} ranks gives each "
            f"{share} samples, which --micro-batch-size {cfg.micro_batch_size} "
            f"does not divide: give a --micro-batch-size that divides {share}"
        )
    return cfg

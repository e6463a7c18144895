"""Standalone (unsplit) training: ``train() -> train_step() -> forward_backward()``.

This is the plain baseline that split training must match to 1e-5, so it stays
an independent code path: one model, one optimizer, ``clip_grad_norm_``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aisyn.data.shards import TokenShards, open_many
from aisyn.model.causal_lm import CausalLM, eod_reset_masks, lm_loss
from aisyn.model.families import (
    ModelConfig,
    build_model,
    config_from_dict,
    hf_folder,
    load_config,
    with_vocab,
)
from aisyn.model.hf import read_hf_folder
from aisyn.train import checkpoint as ckpt
from aisyn.train import distributed
from aisyn.train.engine import Engine, Regime, check_resume_target, finished_summary
from aisyn.train.memory import check_fits, compute_dtype, whole_model_bytes
from aisyn.train.run import RunDir
from aisyn.train.sampler import BatchSampler
from aisyn.train.schedule import lr_at
from aisyn.train.update import apply_update
from aisyn.validate import check_device, check_int, check_number, check_seed

log = logging.getLogger("aisyn.train")


@dataclass
class TrainConfig:
    """Run-level training settings (the model's shape lives in ``ModelConfig``)."""

    steps: int = 200
    batch_size: int = 8  # samples per optimizer step
    micro_batch_size: int | None = None  # None: no gradient accumulation
    lr: float = 1e-3
    min_lr: float | None = None  # None: lr / 10
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global L2 norm; 0 disables
    seed: int = 1234
    log_every: int = 10
    ckpt_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    eval_every: int = 0  # 0: no validation during training
    eval_batches: int = 8
    eod_reset: bool = False  # reset attention/positions at each EOD
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        mb = self.micro_batch_size or self.batch_size
        if mb < 1 or self.batch_size % mb:
            raise ValueError(
                f"micro_batch_size {mb} must divide batch_size {self.batch_size}"
            )
        # Range checks here, not only on flags: a TrainConfig also comes from
        # run folders, federated TOML files and the data party's hello.
        check_number("lr", self.lr, low=0, low_open=True)
        if self.min_lr is not None:
            check_number("min_lr", self.min_lr, low=0)
        check_number("weight_decay", self.weight_decay, low=0)
        check_number("grad_clip", self.grad_clip, low=0)
        check_int("warmup_steps", self.warmup_steps, low=0)
        check_seed("seed", self.seed)
        check_int("log_every", self.log_every, low=1)
        check_int("ckpt_every", self.ckpt_every, low=0)
        check_int("keep_checkpoints", self.keep_checkpoints, low=1)
        check_int("eval_every", self.eval_every, low=0)
        check_int("eval_batches", self.eval_batches, low=1)

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


def model_config_for(
    model: ModelConfig | str | Path, tokenizer: dict, data_seq_len: int
) -> ModelConfig:
    """The model config with the vocabulary of the data's tokenizer (so that
    ``aisyn train`` and ``aisyn split train`` build the same model); ValueError
    if the data's samples are longer than its positions.

    A pretrained model (``hf:DIR``) keeps its vocabulary: its embedding rows
    are fixed, so the data's tokenizer must fit in them.
    """
    mcfg = load_config(model) if isinstance(model, str | Path) else model
    if isinstance(model, str | Path) and hf_folder(model) is not None:
        if tokenizer["vocab_size"] > mcfg.vocab_size:
            raise ValueError(
                f"the data's tokenizer has {tokenizer['vocab_size']} pieces, the "
                f"model {model} embeds {mcfg.vocab_size}: prepare the data with "
                "the model's own tokenizer"
            )
    elif mcfg.vocab_size != tokenizer["vocab_size"]:
        log.info(
            "model vocab_size %d -> %d (the tokenizer's)",
            mcfg.vocab_size,
            tokenizer["vocab_size"],
        )
        mcfg = with_vocab(mcfg, tokenizer["vocab_size"])
    if data_seq_len > mcfg.seq_len:
        raise ValueError(
            f"data seq_len {data_seq_len} exceeds the model's {mcfg.seq_len}"
        )
    return mcfg


def resolve_device(name: str) -> torch.device:
    check_device(name)  # a clear error, not torch's RuntimeError/AssertionError
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA; plain fp32 on CPU (exact and reproducible)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


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


def micro_batches(batch: torch.Tensor, micro: int, eod_id: int | None):
    """Yield (inputs, targets, attn_mask, position_ids) per micro-batch."""
    for mb in batch.split(micro):
        inputs, targets = mb[:, :-1], mb[:, 1:]
        if eod_id is not None:
            mask, pos = eod_reset_masks(inputs, eod_id)
        else:
            mask, pos = None, None
        yield inputs, targets, mask, pos


def forward_backward(
    model: nn.Module, batch: torch.Tensor, cfg: TrainConfig, eod_id: int | None
) -> float:
    """Accumulate gradients over micro-batches; returns the step's mean loss.

    ``batch`` is this process's share of the step's samples (all of them unless
    data-parallel); under DDP gradients are synchronised on the last micro-batch
    only.
    """
    micro = list(micro_batches(batch, cfg.micro, eod_id))
    total = 0.0
    with autocast_for(batch.device):
        for i, (inputs, targets, mask, pos) in enumerate(micro):
            sync = i == len(micro) - 1 or not isinstance(model, DDP)
            with nullcontext() if sync else model.no_sync():
                loss = lm_loss(model(inputs, mask, pos), targets) / len(micro)
                loss.backward()
            total += loss.item()
    return total


def train_step(
    model: CausalLM,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    step: int,
    cfg: TrainConfig,
    eod_id: int | None,
) -> dict:
    lr = cfg.lr_at(step)
    loss = forward_backward(model, batch, cfg, eod_id)
    norm = apply_update(
        optimizer,
        list(model.parameters()),
        step=step,
        lr=lr,
        grad_clip=cfg.grad_clip,
        loss=loss,
    )
    return {"loss": loss, "lr": lr, "grad_norm": norm}


@torch.no_grad()
def evaluate_loss(
    model: CausalLM,
    shards: TokenShards,
    *,
    batch_size: int,
    max_batches: int | None = None,
    eod_id: int | None = None,
    device: torch.device | None = None,
) -> float:
    """Mean next-token loss over (the first ``max_batches`` batches of) a split."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    n = len(shards)
    stop = n if max_batches is None else min(n, max_batches * batch_size)
    total, count = 0.0, 0
    with autocast_for(device):
        for start in range(0, stop, batch_size):
            batch = shards.batch(range(start, min(stop, start + batch_size))).to(device)
            for inputs, targets, mask, pos in micro_batches(batch, len(batch), eod_id):
                loss = lm_loss(model(inputs, mask, pos), targets)
                total += loss.item() * targets.numel()
                count += targets.numel()
    model.train(was_training)
    if count == 0:
        raise ValueError(f"{shards.data_dir}: the {shards.split!r} split is empty")
    return total / count


def train(
    model_config: ModelConfig | str,
    data_dirs: Sequence[str | Path],
    out: str | Path,
    cfg: TrainConfig,
    *,
    resume: bool = False,
    init_from: str | Path | None = None,
    progress: bool = True,
    tensorboard: bool = False,
) -> dict:
    """Train from scratch (or ``init_from`` a checkpoint) and write a run folder.

    Returns a summary: final loss, steps, tokens, elapsed seconds, run path.
    """
    sources = open_many(data_dirs, "train")
    tok = sources[0].tokenizer_info
    mcfg = model_config_for(model_config, tok, sources[0].seq_len)
    if init_from is None and isinstance(model_config, str | Path):
        if hf_folder(model_config) is not None:
            init_from = model_config  # a pretrained folder brings its weights
    cfg = per_rank_micro_batches(cfg, distributed.world_size())
    run = RunDir(out)
    last = ckpt.latest(run.checkpoints) if resume else None
    state = ckpt.read_state(last) if last is not None else {}
    ctx, device = distributed.setup(resolve_device(cfg.device))
    check_fits(
        whole_model_bytes(mcfg, cfg.micro, sources[0].seq_len, compute_dtype(device)),
        device,
        f"training with micro-batches of {cfg.micro}",
    )
    config = {
        "kind": "train",
        "model": mcfg.to_dict(),
        "train": cfg.to_dict(),
        "data": [str(Path(d).resolve()) for d in data_dirs],
        "tokenizer": tok,
        "seq_len": sources[0].seq_len,
        "init_from": str(init_from) if init_from else None,
    }
    # Checked before the folder is rewritten or the model built: a resume
    # with nothing left to do neither trains nor touches the run.
    if last is not None:
        run.check_same_model(config)
        if not check_resume_target(state["step"], cfg.steps, run):
            distributed.teardown(ctx)
            return finished_summary(run, state)
    if ctx.is_main:
        run.create(config, resume=resume)
        run.copy_tokenizer(sources[0].data_dir / sources[0].tokenizer_info["file"])
    ctx.barrier()

    model = build_model(mcfg, seed=cfg.seed).to(device)
    if init_from:
        load_model_checkpoint(model, init_from)
    named = list(model.named_parameters())
    optimizer = make_optimizer(named, cfg)
    # DDP wraps after the optimizer and checkpoints are set up on plain names.
    net: nn.Module = DDP(model) if ctx.enabled else model
    sampler = BatchSampler(sources, seed=cfg.seed)
    eod_id = tok["eod_id"] if cfg.eod_reset else None
    valid = None
    if cfg.eval_every:
        valid = open_many(data_dirs[:1], "valid")[0]

    regime = Pretraining(
        net, model, optimizer, named, sampler, ctx, cfg, eod_id, valid, run, mcfg
    )
    engine = Engine.for_config(
        run,
        cfg,
        desc="train",
        progress=progress,
        main=ctx.is_main,
        tensorboard=tensorboard,
    )
    start_step = 0
    if last is not None:
        ckpt.load_weights(model, ckpt.read_tensors(last / ckpt.MODEL_FILE), str(last))
        opt_t = ckpt.read_tensors(last / ckpt.OPTIM_FILE)
        ckpt.load_optimizer_tensors(optimizer, dict(named), opt_t, str(last))
        ckpt.restore_rng(opt_t)
        engine.load_state_dict(state)
        regime.load_state_dict(state)
        start_step = state["step"]
        log.info("resumed from %s (step %d)", last, start_step)
    elif resume:
        log.info("%s: no checkpoint yet; starting from step 0", run.path)
    if resume and ctx.is_main:
        # Also from step 0: the killed attempt's rows would otherwise stay
        # in front of the rerun's (steps 1, 2, 1, 2, 3, ...).
        run.truncate_metrics(start_step)

    model.train()
    try:
        summary = engine.run(regime, range(start_step, cfg.steps))
    finally:
        distributed.teardown(ctx)
    del summary["records"]
    return summary


class Pretraining(Regime):
    """Standalone (or data-parallel) language-model training on token shards."""

    def __init__(
        self,
        net: nn.Module,
        model: CausalLM,
        optimizer: torch.optim.Optimizer,
        named: list[tuple[str, nn.Parameter]],
        sampler: BatchSampler,
        ctx: distributed.DistContext,
        cfg: TrainConfig,
        eod_id: int | None,
        valid: TokenShards | None,
        run: RunDir,
        mcfg: ModelConfig,
    ) -> None:
        self.net, self.model, self.optimizer = net, model, optimizer
        self.named, self.sampler, self.ctx = named, sampler, ctx
        self.cfg, self.eod_id, self.valid, self.run, self.mcfg = (
            cfg,
            eod_id,
            valid,
            run,
            mcfg,
        )
        self.device = next(model.parameters()).device
        self.tokens_per_step = cfg.batch_size * sampler.sources[0].seq_len
        self.steps_per_epoch = max(1, sampler.total // cfg.batch_size)

    def train_step(self, step: int) -> dict:
        batch = self.sampler.next_batch(self.cfg.batch_size)
        batch = self.ctx.shard(batch).to(self.device)
        result = train_step(
            self.net, self.optimizer, batch, step, self.cfg, self.eod_id
        )
        result["loss"] = self.ctx.mean(result["loss"], self.device)
        return result

    def record_fields(self) -> dict:
        return {"epoch": self.sampler.epoch}

    def log_line(self, done: int, total: int, record: dict) -> str:
        epoch = (done - 1) // self.steps_per_epoch
        return f"epoch {epoch} step {done}/{total} loss: {record['loss']:.6f}"

    def validate(self) -> float | None:
        if self.valid is None:
            return None
        return evaluate_loss(
            self.model,
            self.valid,
            batch_size=self.cfg.batch_size,
            max_batches=self.cfg.eval_batches,
            eod_id=self.eod_id,
        )

    def save(self, step: int, state: dict) -> None:
        names = {p: n for n, p in self.named}
        ckpt.save(
            self.run.checkpoints,
            step,
            {
                ckpt.MODEL_FILE: ckpt.unique_state_dict(self.model),
                ckpt.OPTIM_FILE: {
                    **ckpt.optimizer_tensors(self.optimizer, names),
                    **ckpt.rng_tensors(),
                },
            },
            {**state, "model": self.mcfg.to_dict(), "train": self.cfg.to_dict()},
            keep=self.cfg.keep_checkpoints,
        )

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])


def load_model_checkpoint(model: nn.Module, path: str | Path) -> Path:
    """Load weights from a run folder (its latest checkpoint), a checkpoint folder,
    a ``.safetensors`` file or ``hf:DIR`` (a Hugging Face model folder);
    returns the file or folder read."""
    folder = hf_folder(path)
    if folder is not None:
        cfg, tensors = read_hf_folder(folder)
        if cfg != model.config:
            raise ValueError(f"{folder}: its config.json is not this model's")
        ckpt.load_weights(model, tensors, str(folder))
        return folder
    path = ckpt.model_file(path)
    ckpt.load_weights(model, ckpt.read_tensors(path), str(path))
    return path


def load_run_model(
    run: str | Path, device: str | torch.device = "cpu"
) -> tuple[CausalLM, dict]:
    """The model of a run folder at its latest checkpoint, and the run's config."""
    run_dir = RunDir(run)
    config = run_dir.read_config()
    try:
        mcfg = config_from_dict(config["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{run_dir.path}/config.json: bad model config ({e})"
        ) from None
    # Built on meta, then filled: a random init of weights about to be
    # overwritten would cost more than reading them (5 s of 6.5 s at 350M).
    model = build_model(mcfg, device="meta")
    load_model_checkpoint(model, run_dir.path)
    return model.to(device).eval(), config

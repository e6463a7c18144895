"""Supervised fine-tuning on cloze items: loss on the answer tokens only.

The same pieces serve every regime of the comparison:

* ``finetune()`` — a standalone or data-fusion run (one or several SFT folders
  pooled) from a base model, writing a run folder of ``"kind": "finetune"`` so
  ``aisyn eval`` scores it in the ``prompt`` format it was trained on;
* ``FineTuning`` — the engine regime of both, and of the local training a
  federated client runs for E steps per
  round (``aisyn.fl.task``), with an optional FedProx proximal term.

Reuses the standalone loop's optimizer (``make_optimizer``), schedule
(``TrainConfig.lr_at``), run folder and checkpoints. Only the positions that
carry a supervised target go through the (vocabulary-sized) output projection.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from aisyn.data.sft import IGNORE, SFTData, cat_batches, open_sft_many
from aisyn.model.causal_lm import CausalLM
from aisyn.model.families import ModelConfig, build_model, config_from_dict
from aisyn.train import checkpoint as ckpt
from aisyn.train.engine import Engine, Regime
from aisyn.train.loop import (
    TrainConfig,
    autocast_for,
    make_optimizer,
    resolve_device,
)
from aisyn.train.lora import Method, apply_method, merged_state_dict
from aisyn.train.memory import check_fits, compute_dtype, whole_model_bytes
from aisyn.train.run import TOKENIZER, RunDir
from aisyn.train.sampler import BatchSampler
from aisyn.train.update import apply_update

log = logging.getLogger("aisyn.finetune")


# --- the base model -----------------------------------------------------------------


@dataclass
class BaseModel:
    """Where a base model lives and what it was made with."""

    path: Path  # its run folder
    checkpoint: Path  # the model.safetensors read
    model: ModelConfig
    tokenizer: dict  # sha256, vocab_size, eod_id, pad_id
    fingerprint: str  # checkpoint.tensors_fingerprint of its weights

    def to_dict(self) -> dict:
        return {
            "path": str(self.path),
            "checkpoint": str(self.checkpoint),
            "fingerprint": self.fingerprint,
        }


def describe_base(base: str | Path) -> BaseModel:
    """Read a base run folder's config and locate its latest weights."""
    run = RunDir(base)
    config = run.read_config()
    try:
        mcfg = config_from_dict(config["model"])
        tok = dict(config["tokenizer"])
        if "sha256" not in tok:
            raise KeyError("tokenizer.sha256")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{run.path}/config.json: not a model run ({e})") from None
    last = ckpt.latest(run.checkpoints)
    if last is None:
        raise ckpt.CheckpointError(f"{run.path}: base run has no checkpoint yet")
    weights = last / ckpt.MODEL_FILE
    if not weights.is_file():
        raise ckpt.CheckpointError(f"{weights}: missing")
    return BaseModel(run.path, weights, mcfg, tok, ckpt.file_fingerprint(weights))


def load_base(
    base: BaseModel | str | Path, device: str | torch.device = "cpu"
) -> tuple[CausalLM, BaseModel]:
    """The base model's weights, without a wasted random init (meta, then load)."""
    info = base if isinstance(base, BaseModel) else describe_base(base)
    model = build_model(info.model, device="meta")
    ckpt.load_weights(model, ckpt.read_tensors(info.checkpoint), str(info.checkpoint))
    return model.to(device).train(), info


def check_data_matches(info: BaseModel, data: Sequence[SFTData]) -> None:
    for d in data:
        if d.tokenizer_info["sha256"] != info.tokenizer["sha256"]:
            raise ValueError(
                f"{d.data_dir}: prepared with tokenizer "
                f"{d.tokenizer_info['sha256'][:12]}, but the base model {info.path} "
                f"uses {info.tokenizer['sha256'][:12]}; re-run `aisyn prepare-sft "
                f"--tokenizer {info.path / TOKENIZER}`"
            )
        if d.seq_len > info.model.seq_len:
            raise ValueError(
                f"{d.data_dir}: sequences of {d.seq_len} tokens exceed the base "
                f"model's seq_len {info.model.seq_len}"
            )


# --- loss and one optimizer step ------------------------------------------------------


def sft_loss_sum(
    model: CausalLM, inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over supervised positions, and their count."""
    return supervised_loss_sum(model.logits, model.hidden(inputs), targets)


def supervised_loss_sum(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """``sft_loss_sum`` from final hidden states (B, T, C) and the head
    ``logits_of``: split fine-tuning's data party computes them apart.

    Only the supervised positions go through the (vocabulary-sized) head.
    """
    sel = targets != IGNORE
    logits = logits_of(hidden[sel]).float()
    return F.cross_entropy(logits, targets[sel], reduction="sum"), int(sel.sum())


@torch.no_grad()
def add_proximal_grad(
    trainable: Sequence[tuple[str, nn.Parameter]],
    anchor: dict[str, torch.Tensor],
    mu: float,
) -> float:
    """FedProx: the gradient of (mu/2)||w - w_global||^2, added in place.

    Returns the term's value. Added to the gradient directly (before clipping,
    as if it were part of the loss) instead of through autograd, which would
    keep a second copy of the graph over every parameter.
    """
    total = 0.0
    for name, p in trainable:
        diff = p.detach() - anchor[name]
        total += float(diff.pow(2).sum())
        if p.grad is None:
            p.grad = diff.mul(mu)
        else:
            p.grad.add_(diff, alpha=mu)
    return 0.5 * mu * total


def sft_step(
    model: CausalLM,
    trainable: Sequence[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    lr: float,
    micro: int,
    grad_clip: float,
    prox_mu: float = 0.0,
    anchor: dict[str, torch.Tensor] | None = None,
    step: int = 0,
) -> dict:
    """One optimizer step (number ``step``, for messages) on a batch; the loss
    is the mean over supervised tokens, whatever the micro-batching."""
    n_tok = int((targets != IGNORE).sum())
    if n_tok == 0:
        raise ValueError("a batch without supervised tokens (corrupt SFT data?)")
    total = 0.0
    with autocast_for(inputs.device):
        for mi, mt in zip(inputs.split(micro), targets.split(micro), strict=True):
            loss_sum, _ = sft_loss_sum(model, mi, mt)
            (loss_sum / n_tok).backward()
            total += loss_sum.item()
    loss = total / n_tok
    record: dict = {"loss": loss, "lr": lr, "answer_tokens": n_tok}
    if prox_mu > 0:
        if anchor is None:
            raise ValueError("FedProx needs the global weights as anchor")
        record["prox"] = add_proximal_grad(trainable, anchor, prox_mu)
    record["grad_norm"] = apply_update(
        optimizer,
        [p for _, p in trainable],
        step=step,
        lr=lr,
        grad_clip=grad_clip,
        loss=loss,
        hint=" (lower the learning rate?)",
    )
    return record


# --- data order -----------------------------------------------------------------------


class SFTBatches:
    """Deterministic batches over one or several SFT sources (pooled for fusion).

    The order is ``BatchSampler``'s (a fresh permutation per epoch from
    ``seed + epoch``), so a federated client that starts a fresh process every
    round can resume exactly where it stopped with ``skip(samples)``.
    """

    def __init__(
        self, sources: Sequence[SFTData], seed: int, device: torch.device
    ) -> None:
        self.sources = list(sources)
        self.sampler = BatchSampler(self.sources, seed)
        self.offsets = np.cumsum([0, *[len(s) for s in self.sources]])
        self.device = device

    def skip(self, samples: int) -> None:
        s = self.sampler
        s.load_state_dict(
            {
                "seed": s.seed,
                "sizes": s.sizes,
                "epoch": samples // s.total,
                "position": samples % s.total,
            }
        )

    @property
    def epoch_float(self) -> float:
        return self.sampler.epoch + self.sampler.position / self.sampler.total

    def next(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = cat_batches(
            self.sources, self.sampler.next_indices(n), self.offsets
        )
        return inputs.to(self.device), targets.to(self.device)


class FineTuning(Regime):
    """Supervised fine-tuning steps (loss on answer tokens only): a standalone
    or data-fusion run, or one federated client's local steps in a round
    (``lr_at`` its round's schedule, ``prox_mu`` FedProx's pull to ``anchor``)."""

    def __init__(
        self,
        model: CausalLM,
        trainable: Sequence[tuple[str, nn.Parameter]],
        optimizer: torch.optim.Optimizer,
        batches: SFTBatches,
        cfg: TrainConfig,
        *,
        lr_at: Callable[[int], float] | None = None,
        prox_mu: float = 0.0,
        anchor: dict[str, torch.Tensor] | None = None,
        valid: SFTData | None = None,
        save: Callable[[int, dict], None] | None = None,
        fields: dict | None = None,
    ) -> None:
        self.model, self.trainable, self.optimizer = model, trainable, optimizer
        self.batches, self.cfg = batches, cfg
        self.lr_at = lr_at or cfg.lr_at
        self.prox_mu, self.anchor, self.valid = prox_mu, anchor, valid
        self._save, self.fields = save, fields or {}
        self.losses: list[float] = []  # every step's, logged or not

    def train_step(self, step: int) -> dict:
        inputs, targets = self.batches.next(self.cfg.batch_size)
        record = sft_step(
            self.model,
            self.trainable,
            self.optimizer,
            inputs,
            targets,
            step=step,
            lr=self.lr_at(step),
            micro=self.cfg.micro,
            grad_clip=self.cfg.grad_clip,
            prox_mu=self.prox_mu,
            anchor=self.anchor,
        )
        self.losses.append(record["loss"])
        return record

    def record_fields(self) -> dict:
        return {**self.fields, "epoch": round(self.batches.epoch_float, 4)}

    def validate(self) -> float | None:
        if self.valid is None:
            return None
        return sft_eval_loss(
            self.model,
            self.valid,
            batch_size=self.cfg.batch_size,
            max_items=self.cfg.eval_batches * self.cfg.batch_size,
        )

    def save(self, step: int, state: dict) -> None:
        if self._save is not None:
            self._save(step, state)


@torch.no_grad()
def sft_eval_loss(
    model: CausalLM,
    data: SFTData,
    *,
    batch_size: int = 32,
    max_items: int | None = None,
) -> float:
    """Mean loss per supervised token over (the first ``max_items`` of) a split."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    n = len(data) if max_items is None else min(len(data), max_items)
    total, count = 0.0, 0
    with autocast_for(device):
        for start in range(0, n, batch_size):
            inputs, targets = data.batch(range(start, min(n, start + batch_size)))
            loss_sum, k = sft_loss_sum(model, inputs.to(device), targets.to(device))
            total += loss_sum.item()
            count += k
    model.train(was_training)
    return total / max(count, 1)


# --- a standalone / data-fusion run ---------------------------------------------------


def finetune_config(
    info: BaseModel,
    data: Sequence[SFTData],
    cfg: TrainConfig,
    method: Method,
    **extra,
) -> dict:
    return {
        "kind": "finetune",
        "model": info.model.to_dict(),
        "train": cfg.to_dict(),
        "method": method.to_dict(),
        "data": [str(d.data_dir.resolve()) for d in data],
        "tokenizer": info.tokenizer,
        "seq_len": data[0].seq_len,
        "base": info.to_dict(),
        **extra,
    }


def save_model(
    run: RunDir, model: nn.Module, step: int, state: dict, keep: int
) -> Path:
    """A checkpoint of plain (adapter-merged) weights; atomic."""
    return ckpt.save(
        run.checkpoints,
        step,
        {ckpt.MODEL_FILE: merged_state_dict(model)},
        state,
        keep=keep,
    )


def finetune(
    base: str | Path,
    data_dirs: Sequence[str | Path],
    out: str | Path,
    cfg: TrainConfig,
    method: Method | None = None,
    *,
    progress: bool = True,
    tensorboard: bool = False,
) -> dict:
    """Fine-tune ``base`` on the pooled SFT folders; returns a summary dict."""
    method = method or Method()
    device = resolve_device(cfg.device)
    info = describe_base(base)
    data = open_sft_many(data_dirs, "train")
    check_data_matches(info, data)
    check_fits(
        whole_model_bytes(
            info.model,
            cfg.micro,
            data[0].seq_len,
            compute_dtype(device),
            # LoRA keeps no gradients or optimizer state for the frozen weights
            trains_all_weights=method.name != "lora",
        ),
        device,
        f"fine-tuning with micro-batches of {cfg.micro}",
    )
    run = RunDir(out)
    run.create(finetune_config(info, data, cfg, method), resume=False)
    run.copy_tokenizer(info.path / TOKENIZER)
    torch.manual_seed(cfg.seed)
    model, _ = load_base(info, device)
    trainable = apply_method(model, method, seed=cfg.seed)
    optimizer = make_optimizer(trainable, cfg)
    batches = SFTBatches(data, cfg.seed, device)
    valid = None
    if cfg.eval_every:
        valid = SFTData.open(data[0].data_dir, "valid")
    regime = FineTuning(
        model,
        trainable,
        optimizer,
        batches,
        cfg,
        valid=valid,
        save=lambda step, state: save_model(
            run,
            model,
            step,
            {**state, "method": method.to_dict()},
            cfg.keep_checkpoints,
        ),
    )
    engine = Engine.for_config(
        run,
        cfg,
        desc="finetune",
        progress=progress,
        tensorboard=tensorboard,
    )
    result = engine.run(regime, range(cfg.steps))
    elapsed, plot = result["elapsed_s"], result["plot"]
    summary = {
        "run": str(run.path),
        "steps": cfg.steps,
        "epochs": round(batches.epoch_float, 4),
        "final_loss": result["final_loss"],
        "elapsed_s": elapsed,
        "trainable_parameters": sum(p.numel() for _, p in trainable),
        "plot": str(plot) if plot else None,
    }
    (run.path / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary

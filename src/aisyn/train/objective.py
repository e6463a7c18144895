"""What a run trains on and what it minimises: the objectives.

An objective gives each optimizer step its micro-batches and the loss of one
micro-batch, and scores a model on its validation split. It knows nothing of
where forward and backward run: the same ``StepBatch`` goes to the local
executor (one model, or DDP) and to the split executor (the data party, the
middle of the model at the compute party), so standalone training, fine-tuning,
data fusion, a federated client's local steps and the split data party train
on the same batches with the same loss.

* ``LMObjective`` -- pre-training on token shards (``aisyn prepare``): windows
  of seq_len + 1 tokens, the mean loss over every next token.
* ``SFTObjective`` -- supervised fine-tuning on cloze items (``aisyn
  prepare-sft``): the mean loss over the batch's supervised tokens (each
  item's answer, or with ``--supervise item`` the whole item); only those
  positions go through the (vocabulary-sized) head.

A loss is computed from the final hidden states and the head (``logits_of``),
so any model with the families' ``hidden``/``logits`` -- or the data party's
segments -- can be trained on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from aisyn.data.sft import IGNORE, SFTData, cat_batches, open_sft_many
from aisyn.data.shards import TokenShards, open_many
from aisyn.model.causal_lm import CausalLM, eod_reset_masks, lm_loss
from aisyn.train.config import TrainConfig
from aisyn.train.device import autocast_for
from aisyn.train.sampler import BatchSampler

#: (inputs, targets, attention mask, position ids) of one micro-batch
MicroBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
#: a micro-batch's loss, scaled to its share of the step, from the final hidden
#: states: ``loss_of(logits_of, hidden, targets)``, ``logits_of`` the head
LossOf = Callable[
    [Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor],
    torch.Tensor,
]


@dataclass(frozen=True)
class RowsLoss:
    """A micro-batch's loss as a sum over its rows: the cross-entropy summed
    over the targets that count (not ``IGNORE``), over ``divisor``. Ranks
    that share a micro-batch's rows (``split.client.data_ranks``) each compute it on
    theirs, and their losses (and gradients) sum to the micro-batch's; it is
    plain data, so rank 0 can hand it to the others."""

    divisor: float
    #: "lm": every position has a target (its logits all computed at once);
    #: "sft": only the answer positions go through the head
    kind: str = "lm"

    def __call__(self, logits_of, hidden, targets) -> torch.Tensor:
        if self.kind == "sft":
            return supervised_loss_sum(logits_of, hidden, targets)[0] / self.divisor
        logits = logits_of(hidden)
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            targets.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        return total / self.divisor

    def to_dict(self) -> dict:
        return {"divisor": self.divisor, "kind": self.kind}

    @classmethod
    def from_dict(cls, d: dict) -> RowsLoss:
        divisor, kind = d.get("divisor"), d.get("kind")
        ok = isinstance(divisor, int | float) and math.isfinite(divisor)
        if not ok or not divisor > 0 or kind not in ("lm", "sft"):
            raise ValueError(
                f"bad rows loss {d!r}: needs a finite divisor > 0 and kind lm or sft"
            )
        return cls(float(divisor), kind)


@dataclass
class StepBatch:
    """One optimizer step's worth of data, ready for any executor."""

    micro: list[MicroBatch]
    loss_of: LossOf  # the micro-batch loss; the step's loss is their sum
    tokens: int  # input positions of the step (the ``tokens`` metric)
    record: dict = field(default_factory=dict)  # what the step's record adds
    #: ``loss_of`` as a sum over rows, where the objective can give it
    rows_loss: RowsLoss | None = None


class Objective:
    """Batches, loss and validation of one kind of training data."""

    #: recorded in the run's config.json (``aisyn eval`` scores by it)
    name: str
    #: the progress bar's label
    desc: str
    tokenizer: dict
    seq_len: int
    eod_id: int | None = None
    valid = None  # the validation split, when this run validates
    sampler: BatchSampler  # its state is the run's data position
    data_dirs: list[Path]

    def start(self, device: torch.device) -> None:
        """Bind to the device the batches go to (after the run folder exists)."""
        raise NotImplementedError

    def next_step(self, batch_size: int, shard=None) -> StepBatch:
        """The next step's batch; ``shard(batch)`` takes this rank's share of
        it under data parallelism."""
        raise NotImplementedError

    def record_fields(self) -> dict:
        raise NotImplementedError

    def log_prefix(self, done: int) -> str:
        return ""

    def validate(self, model) -> float | None:
        """The validation loss of ``model`` (any ``hidden``/``logits`` model),
        or None when this run does not validate."""
        raise NotImplementedError

    @property
    def tokenizer_file(self) -> Path:
        return self.data_dirs[0] / self.tokenizer["file"]

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])


# --- pre-training ------------------------------------------------------------------


def micro_batches(
    batch: torch.Tensor, micro: int, eod_id: int | None
) -> Iterator[MicroBatch]:
    """Yield (inputs, targets, attn_mask, position_ids) per micro-batch."""
    for mb in batch.split(micro):
        inputs, targets = mb[:, :-1], mb[:, 1:]
        if eod_id is not None:
            mask, pos = eod_reset_masks(inputs, eod_id)
        else:
            mask, pos = None, None
        yield inputs, targets, mask, pos


def lm_step_batch(batch: torch.Tensor, micro: int, eod_id: int | None) -> StepBatch:
    """A step of language modelling on ``batch`` (n, T+1): micro-batches of
    ``micro`` rows, each one's loss the mean over its next tokens divided by
    the number of micro-batches, so that the step's loss is the batch's mean."""
    micro_list = list(micro_batches(batch, micro, eod_id))
    n = len(micro_list)

    def loss_of(logits_of, hidden, targets):
        return lm_loss(logits_of(hidden), targets) / n

    rows, T = micro_list[0][1].shape
    equal = all(len(m[1]) == rows for m in micro_list)
    return StepBatch(
        micro_list,
        loss_of,
        batch.shape[0] * (batch.shape[1] - 1),
        rows_loss=RowsLoss(float(rows * T * n)) if equal else None,
    )


class LMObjective(Objective):
    """Pre-training on token shards: fixed windows of seq_len + 1 tokens, the
    loss the mean over every next token of a micro-batch, divided by the number
    of micro-batches (so the step's loss is the batch's mean)."""

    name = "lm"
    desc = "train"

    def __init__(
        self,
        data_dirs: Sequence[str | Path],
        cfg: TrainConfig,
        *,
        sources: Sequence[TokenShards] | None = None,
    ) -> None:
        self.data_dirs, self.cfg = [Path(d) for d in data_dirs], cfg
        self.sources = list(sources) if sources else open_many(data_dirs, "train")
        self.tokenizer = self.sources[0].tokenizer_info
        self.seq_len = self.sources[0].seq_len
        self.eod_id = self.tokenizer["eod_id"] if cfg.eod_reset else None
        self.sampler = BatchSampler(self.sources, seed=cfg.seed)
        self.steps_per_epoch = max(1, self.sampler.total // cfg.batch_size)

    def start(self, device: torch.device) -> None:
        self.device = device
        self.valid = (
            open_many(self.data_dirs[:1], "valid")[0] if self.cfg.eval_every else None
        )

    def next_step(self, batch_size: int, shard=None) -> StepBatch:
        """(The tokens metric stays the whole step's under data parallelism.)"""
        batch = self.sampler.next_batch(batch_size)
        if shard is not None:
            batch = shard(batch)
        step = lm_step_batch(batch.to(self.device), self.cfg.micro, self.eod_id)
        step.tokens = batch_size * self.seq_len
        return step

    def record_fields(self) -> dict:
        return {"epoch": self.sampler.epoch}

    def log_prefix(self, done: int) -> str:
        return f"epoch {(done - 1) // self.steps_per_epoch} "

    def validate(self, model) -> float | None:
        if self.valid is None:
            return None
        return evaluate_loss(
            model,
            self.valid,
            batch_size=self.cfg.batch_size,
            max_batches=self.cfg.eval_batches,
            eod_id=self.eod_id,
            device=self.device,
        )


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
    device = device or next(model.parameters()).device
    n = len(shards)
    stop = n if max_batches is None else min(n, max_batches * batch_size)

    def loss_sums():
        for start in range(0, stop, batch_size):
            batch = shards.batch(range(start, min(stop, start + batch_size))).to(device)
            for inputs, targets, mask, pos in micro_batches(batch, len(batch), eod_id):
                loss = lm_loss(model(inputs, mask, pos), targets)
                yield loss.item() * targets.numel(), targets.numel()

    total, count = _summed(model, device, loss_sums())
    if count == 0:
        raise ValueError(f"{shards.data_dir}: the {shards.split!r} split is empty")
    return total / count


@torch.no_grad()
def _summed(model, device: torch.device, loss_sums) -> tuple[float, int]:
    """The summed losses and counts ``loss_sums`` yields, run with ``model`` in
    eval mode (and back to the mode it was in) under the device's autocast."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with autocast_for(device):
        for loss_sum, k in loss_sums:
            total += loss_sum
            count += k
    model.train(was_training)
    return total, count


# --- supervised fine-tuning --------------------------------------------------------


def supervised_loss_sum(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the supervised positions of final hidden
    states (B, T, C) under the head ``logits_of``, and their count.

    Only the supervised positions go through the (vocabulary-sized) head.
    """
    sel = targets != IGNORE
    logits = logits_of(hidden[sel]).float()
    return F.cross_entropy(logits, targets[sel], reduction="sum"), int(sel.sum())


def sft_loss_sum(
    model: CausalLM, inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """``supervised_loss_sum`` of a whole model on ``inputs``."""
    return supervised_loss_sum(model.logits, model.hidden(inputs), targets)


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


def sft_step_batch(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    micro: int,
    shard=None,
) -> StepBatch:
    """A step of fine-tuning on a padded batch: micro-batches of ``micro``
    rows, each one's loss its summed answer-token loss over the batch's
    answer tokens, so that the step's loss is the batch's mean.

    With ``shard`` (data parallelism) only this rank's rows are run, still over
    the whole batch's answer tokens and times the ranks: DDP averages the
    ranks' gradients, so the step's gradient is the whole batch's."""
    answer_tokens = int((targets != IGNORE).sum())
    if answer_tokens == 0:
        raise ValueError("a batch without supervised tokens (corrupt SFT data?)")
    scale = 1
    if shard is not None:
        rows = len(inputs)
        inputs, targets = shard(inputs), shard(targets)
        scale = rows // len(inputs)

    def loss_of(logits_of, hidden, targets):
        loss = supervised_loss_sum(logits_of, hidden, targets)[0] / answer_tokens
        return loss * scale if scale > 1 else loss

    micro_list: list[MicroBatch] = [
        (mi, mt, None, None)
        for mi, mt in zip(inputs.split(micro), targets.split(micro), strict=True)
    ]
    return StepBatch(
        micro_list,
        loss_of,
        inputs.numel(),
        {"answer_tokens": answer_tokens},
        rows_loss=None if scale > 1 else RowsLoss(float(answer_tokens), "sft"),
    )


class SFTObjective(Objective):
    """Fine-tuning on supervised items: batches right-padded to the batch's
    longest sequence, the loss the mean over the batch's answer tokens.

    Split, nothing of it crosses but the activations: B is not told the answer
    positions, the lengths or the loss. Right padding needs no mask at B --
    attention is causal, so a padded position never reaches an earlier one --
    and padded positions carry no target (``IGNORE``), so the loss skips them.
    """

    name = "sft"
    desc = "finetune"

    def __init__(
        self,
        data_dirs: Sequence[str | Path],
        cfg: TrainConfig,
        *,
        sources: Sequence[SFTData] | None = None,
    ) -> None:
        if cfg.eod_reset:
            raise ValueError(
                "--eod-reset does not apply to --sft data (one item per sequence)"
            )
        self.data_dirs, self.cfg = [Path(d) for d in data_dirs], cfg
        self.sources = list(sources) if sources else open_sft_many(data_dirs, "train")
        self.tokenizer = self.sources[0].tokenizer_info
        self.seq_len = self.sources[0].seq_len

    def start(self, device: torch.device) -> None:
        self.batches = SFTBatches(self.sources, self.cfg.seed, device)
        self.sampler = self.batches.sampler
        if self.cfg.eval_every:
            self.valid = SFTData.open(self.data_dirs[0], "valid")

    def next_step(self, batch_size: int, shard=None) -> StepBatch:
        inputs, targets = self.batches.next(batch_size)
        return sft_step_batch(inputs, targets, self.cfg.micro, shard)

    def record_fields(self) -> dict:
        return {"epoch": round(self.batches.epoch_float, 4)}

    def validate(self, model) -> float | None:
        if self.valid is None:
            return None
        return sft_eval_loss(
            model,
            self.valid,
            batch_size=self.cfg.batch_size,
            max_items=self.cfg.eval_batches * self.cfg.batch_size,
        )


def sft_eval_loss(
    model: CausalLM,
    data: SFTData,
    *,
    batch_size: int = 32,
    max_items: int | None = None,
) -> float:
    """Mean loss per supervised token over (the first ``max_items`` of) a split."""
    device = next(model.parameters()).device
    n = len(data) if max_items is None else min(len(data), max_items)

    def loss_sums():
        for start in range(0, n, batch_size):
            inputs, targets = data.batch(range(start, min(n, start + batch_size)))
            loss_sum, k = sft_loss_sum(model, inputs.to(device), targets.to(device))
            yield loss_sum.item(), k

    total, count = _summed(model, device, loss_sums())
    return total / max(count, 1)

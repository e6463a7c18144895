"""The local executor: a step's forward and backward on the whole model here.

``LocalExecutor`` is the plain baseline: one model (or its DDP replicas), one
optimizer, ``clip_grad_norm_``'s clip. Split training must match it to 1e-5,
so split code never imports this module (a contract in pyproject.toml): an
independent code path on each side is what makes that equality mean
something. The interface every executor implements is
``train.regime.Executor``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aisyn.train import checkpoint as ckpt
from aisyn.train import fsdp
from aisyn.train.config import TrainConfig
from aisyn.train.device import autocast_for
from aisyn.train.distributed import DistContext
from aisyn.train.lora import Method, merged_state_dict
from aisyn.train.objective import StepBatch
from aisyn.train.optim import make_optimizer
from aisyn.train.recompute import checkpoint_blocks
from aisyn.train.regime import Executor
from aisyn.train.run import RunDir
from aisyn.train.update import apply_update

#: a LoRA run's adapters (with its optimizer: what resuming it needs); its
#: ``model.safetensors`` holds the merged weights, which ``aisyn eval`` reads
ADAPTERS_FILE = "adapters.safetensors"


class MicroBatchLoss(nn.Module):
    """One micro-batch's loss as a module's forward, so that DDP or FSDP2
    wraps the whole of it (its hooks see every parameter the loss uses, the
    head too); without ``loss_of``, the logits (validation, through the same
    hooks)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs, targets, mask, pos, loss_of=None) -> torch.Tensor:
        hidden = self.model.hidden(inputs, mask, pos)
        if loss_of is None:
            return self.model.logits(hidden)
        return loss_of(self.model.logits, hidden, targets)


class Logits(nn.Module):
    """``model(inputs, mask, pos)`` of a sharded model: through its root's
    forward, which gathers the weights the blocks' own do not hold."""

    def __init__(self, root: MicroBatchLoss) -> None:
        super().__init__()
        self.root = root

    def forward(self, inputs, mask=None, pos=None) -> torch.Tensor:
        return self.root(inputs, None, mask, pos)


class LocalExecutor(Executor):
    """The whole model here: standalone, fine-tuning, fusion, a federated
    client's local steps, and (with ``ctx``) data-parallel ranks.

    ``trainable``: the (name, parameter) pairs the optimizer steps (all of
    them, or LoRA's adapters); ``lr_at``: the schedule (default the config's;
    a federated client's follows its round); ``regularizer``: called between
    backward and the update, it adds its own gradient and returns what the
    record shows of it (FedProx's proximal term); ``resumable``: checkpoints
    hold the optimizer and RNG too (a federated client's hold the weights);
    ``optimizer``: another than the one AdamW recipe (``train.optim``);
    ``extra_files``: more files for each checkpoint (name -> tensors), from
    whatever wraps this executor (DiLoCo's outer optimizer); ``parallel``:
    over ``ctx``'s ranks, ``ddp`` (a replica each) or ``fsdp`` (FSDP2: each
    rank a shard of the weights, gradients and moments; ``train.fsdp``).
    """

    def __init__(
        self,
        model: nn.Module,
        trainable: Sequence[tuple[str, nn.Parameter]],
        cfg: TrainConfig,
        *,
        method: Method | None = None,
        ctx: DistContext | None = None,
        lr_at: Callable[[int], float] | None = None,
        regularizer: Callable[[], dict] | None = None,
        resumable: bool = True,
        checkpoint_fields: dict | None = None,
        hint: str = " (lower --lr?)",
        optimizer: torch.optim.Optimizer | None = None,
        extra_files: Callable[[], dict] | None = None,
        parallel: str = "ddp",
    ) -> None:
        if parallel not in ("ddp", "fsdp"):
            raise ValueError(f"--data-parallel {parallel!r}: ddp or fsdp")
        self.model = model
        self.extra_files = extra_files
        self.trainable = list(trainable)
        self.params = [p for _, p in self.trainable]
        self.cfg = cfg
        self.method = method or Method()
        self.ctx = ctx or DistContext()
        self.lr_at = lr_at or cfg.lr_at
        self.regularizer = regularizer
        self.resumable = resumable
        self.checkpoint_fields = checkpoint_fields or {}
        self.hint = hint
        self.device = next(model.parameters()).device
        if cfg.activation_checkpointing:
            checkpoint_blocks(model, model.config.layout)
        loss = MicroBatchLoss(model)
        self.fsdp = parallel == "fsdp" and self.ctx.enabled
        if self.fsdp:
            if self.method.name == "lora" or optimizer is not None or regularizer:
                raise ValueError(
                    "--data-parallel fsdp shards a whole model's training; "
                    "not LoRA's, another optimizer's or a regularizer's"
                )
            # the parameters become DTensor shards (their names unchanged):
            # the optimizer is built over those
            fsdp.shard_model(loss, model, self.ctx.group)
            params = dict(model.named_parameters())
            self.trainable = [(n, params[n]) for n, _ in self.trainable]
            self.params = [p for _, p in self.trainable]
        self.optimizer = optimizer or make_optimizer(self.trainable, cfg)
        # DDP wraps after the optimizer and checkpoints are set up on plain names.
        self.loss: nn.Module = (
            DDP(loss, process_group=self.ctx.group)
            if self.ctx.enabled and not self.fsdp
            else loss
        )

    def release(self) -> None:
        """Drop the DDP wrapper while the process group is still up. Freed
        after ``destroy_process_group``, its reducer would be the group's last
        holder and join gloo's worker threads holding the GIL, which one of
        them may need to free a finished collective: a hang at exit, seen on
        one rank in three (pytorch#56297)."""
        if isinstance(self.loss, DDP):
            self.loss = self.loss.module

    def step(self, step: int, batch: StepBatch) -> dict:
        lr = self.lr_at(step)
        micro = batch.micro
        total = 0.0
        with autocast_for(self.device, self.cfg.autocast):
            for i, (inputs, targets, mask, pos) in enumerate(micro):
                # gradients are synchronised on the last micro-batch
                sync = i == len(micro) - 1
                if self.fsdp:
                    self.loss.set_requires_gradient_sync(sync)
                ddp = isinstance(self.loss, DDP)
                with self.loss.no_sync() if ddp and not sync else nullcontext():
                    loss = self.loss(inputs, targets, mask, pos, batch.loss_of)
                    loss.backward()
                total += loss.item()
        record: dict = {"loss": total, "lr": lr, **batch.record}
        if self.regularizer is not None:
            record.update(self.regularizer())
        record["grad_norm"] = apply_update(
            self.optimizer,
            self.params,
            step=step,
            lr=lr,
            grad_clip=self.cfg.grad_clip,
            loss=total,
            hint=self.hint,
        )
        record["loss"] = self.ctx.mean(total, self.device)
        return record

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        return self.ctx.shard(batch)

    def eval_model(self) -> nn.Module:
        return Logits(self.loss) if self.fsdp else self.model

    @property
    def collective(self) -> bool:
        return self.fsdp

    @property
    def adapters(self) -> bool:
        return self.method.name == "lora"

    def save(self, run: RunDir, step: int, state: dict, keep: int) -> None:
        if self.fsdp:
            self._save_gathered(run, step, state, keep)
            return
        files = {}
        if self.resumable:
            names = {p: n for n, p in self.trainable}
            files[ckpt.OPTIM_FILE] = {
                **ckpt.optimizer_tensors(self.optimizer, names),
                **ckpt.rng_tensors(),
            }
            if self.adapters:
                files[ADAPTERS_FILE] = {
                    n: p.detach().contiguous() for n, p in self.trainable
                }
        if self.extra_files is not None:
            files.update(self.extra_files())
        save_model(
            run,
            self.model,
            step,
            {**state, **self.checkpoint_fields},
            keep,
            adapters=self.adapters,
            files=files,
        )

    def _save_gathered(self, run: RunDir, step: int, state: dict, keep: int) -> None:
        """Every rank gathers each sharded tensor in turn; rank 0 writes the
        files DDP's rank 0 would (the same names, every tensor whole)."""
        main = self.ctx.is_main
        names = {p: n for n, p in self.trainable}
        weights = ckpt.unique_state_dict(self.model).items()
        files = {
            ckpt.MODEL_FILE: fsdp.full_tensors(weights, main),
            ckpt.OPTIM_FILE: {
                **fsdp.full_tensors(
                    ckpt.optimizer_tensors(self.optimizer, names).items(), main
                ),
                **ckpt.rng_tensors(),
            },
        }
        if self.extra_files is not None:
            files.update(self.extra_files())
        if main:
            ckpt.save(
                run.checkpoints, step, files, {**state, **self.checkpoint_fields}, keep
            )

    def load(self, folder: Path | None) -> dict | None:
        if folder is None:
            return None  # the model was built (or loaded) as the run starts
        state = ckpt.read_state(folder)
        if self.fsdp:
            where = str(folder)
            fsdp.load_weights(
                self.model, ckpt.read_tensors(folder / ckpt.MODEL_FILE), where
            )
            opt = ckpt.read_tensors(folder / ckpt.OPTIM_FILE)
            fsdp.load_optimizer(self.optimizer, dict(self.trainable), opt, where)
            ckpt.restore_rng(opt)
            return state
        if self.adapters:
            adapters = ckpt.read_tensors(folder / ADAPTERS_FILE)
            where = str(folder / ADAPTERS_FILE)
            ckpt.load_exactly(dict(self.trainable), adapters, where, "this run's")
        else:
            ckpt.load_weights(
                self.model, ckpt.read_tensors(folder / ckpt.MODEL_FILE), str(folder)
            )
        opt = ckpt.read_tensors(folder / ckpt.OPTIM_FILE)
        ckpt.load_optimizer_tensors(
            self.optimizer, dict(self.trainable), opt, str(folder)
        )
        ckpt.restore_rng(opt)
        return state


def save_model(
    run: RunDir,
    model: nn.Module,
    step: int,
    state: dict,
    keep: int,
    *,
    adapters: bool,
    files: dict | None = None,
) -> Path:
    """Checkpoint ``step`` of ``model``: its ``model.safetensors`` holds plain
    weights (LoRA ``adapters`` merged in), what ``aisyn eval`` and a base
    model's readers load; ``files`` adds what resuming needs. Atomic."""
    weights = merged_state_dict(model) if adapters else ckpt.unique_state_dict(model)
    return ckpt.save(
        run.checkpoints, step, {ckpt.MODEL_FILE: weights, **(files or {})}, state, keep
    )

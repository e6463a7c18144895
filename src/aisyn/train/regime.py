"""The one training regime: an objective, an executor and a training config.

``Regime(objective, executor, cfg)`` is what the engine runs, for every way
this project trains: pre-training, fine-tuning and data fusion (``LMObjective``
/ ``SFTObjective`` x ``LocalExecutor``), a federated client's local steps (the
same, with its round's schedule and FedProx's term), and the split data party
(either objective x ``split.client.executor.SplitExecutor``). Each step takes the
objective's next batch to the executor; validation scores the executor's model
on the objective's split; a checkpoint is the executor's tensors plus the
engine's and the objective's resume state.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from aisyn.train.config import TrainConfig
from aisyn.train.objective import Objective, StepBatch
from aisyn.train.run import RunDir


class Executor:
    """Where a regime's steps run: the whole model here
    (``train.executor.LocalExecutor``) or split with a compute party
    (``split.client.executor.SplitExecutor``). A new one -- the backbone over several
    devices, several data parties on one backbone -- implements this and plugs
    into the one regime."""

    def step(self, step: int, batch: StepBatch) -> dict:
        """One optimizer step over ``batch`` (0-based ``step``); its record:
        ``loss`` (the sum of the micro-batches' losses), ``lr``, ``grad_norm``,
        ``batch.record`` and what this executor measures."""
        raise NotImplementedError

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This executor's share of a global batch (data parallelism)."""
        return batch

    def eval_model(self) -> nn.Module:
        """A model with ``hidden``/``logits`` for the objective to validate."""
        raise NotImplementedError

    def log_suffix(self, record: dict) -> str:
        return ""

    @property
    def collective(self) -> bool:
        """Whether validating and checkpointing take every rank (FSDP2's
        sharded weights are gathered for both); False: rank 0's alone."""
        return False

    def save(self, run: RunDir, step: int, state: dict, keep: int) -> None:
        """Checkpoint after ``step`` steps with ``state`` (for ``state.json``)."""
        raise NotImplementedError

    def load(self, folder: Path | None) -> dict | None:
        """Put the weights in place: from checkpoint ``folder`` (its state.json
        returned) or, for None, as a fresh run starts (None returned)."""
        raise NotImplementedError

    def summary(self, steps_run: int) -> dict:
        """What this executor adds to the run's summary."""
        return {}


class Regime:
    """What the engine runs: ``objective`` x ``executor`` under ``cfg``.

    ``fields`` go into every metrics record and checkpoint (a federated
    client's ``round``); ``keep``: checkpoints kept (default the config's).
    """

    def __init__(
        self,
        objective: Objective,
        executor: Executor,
        cfg: TrainConfig,
        run: RunDir,
        *,
        fields: dict | None = None,
        keep: int | None = None,
    ) -> None:
        self.objective = objective
        self.executor = executor
        self.cfg = cfg
        self.run = run
        self.fields = fields or {}
        self.keep = cfg.keep_checkpoints if keep is None else keep
        self.tokens_per_step = 0  # the objective's, set each step
        self.losses: list[float] = []  # every step's, logged or not

    def train_step(self, step: int) -> dict:
        batch = self.objective.next_step(self.cfg.batch_size, self.executor.shard)
        record = self.executor.step(step, batch)
        self.tokens_per_step = batch.tokens
        self.losses.append(record["loss"])
        return record

    def record_fields(self) -> dict:
        return {**self.fields, **self.objective.record_fields()}

    def log_line(self, done: int, total: int, record: dict) -> str:
        return (
            f"{self.objective.log_prefix(done)}step "
            f"{done}/{total} loss: {record['loss']:.6f}"
            f"{self.executor.log_suffix(record)}"
        )

    def validate(self) -> float | None:
        if self.objective.valid is None:
            return None  # (and the split executor counts no validation)
        return self.objective.validate(self.executor.eval_model())

    def save(self, step: int, state: dict) -> None:
        self.executor.save(self.run, step, {**state, **self.fields}, self.keep)

    def state_dict(self) -> dict:
        return self.objective.state_dict()

    def load(self, folder: Path | None) -> dict | None:
        """Weights, optimizer, RNG and data position from checkpoint
        ``folder``, returning its state (None: a fresh start)."""
        state = self.executor.load(folder)
        if state is not None:
            self.objective.load_state_dict(state)
        return state

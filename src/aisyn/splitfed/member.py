"""One data party of a SplitFed consortium: its own segments and data, the
consortium's backbone at the compute party.

A member is a split data party (``split.client.data_party``) whose session runs
against the consortium's shared backbone (``split.centre.consortium``) instead of a
backbone of its own. Each federated round it takes the global front and back
(the average of every member's), trains its local steps through the backbone
-- under the one regime, as ``aisyn split train --sft`` does -- and returns
its segments for the next average. Its tokens, labels and loss stay here; B
sees only cut activations and their gradients; the other members see only
the averaged segments the federation sends back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aisyn.data.sft import SFTData
from aisyn.fl.client import add_proximal_grad
from aisyn.link.base import Link
from aisyn.split.client.data_party import DataSession, SplitModel
from aisyn.split.client.executor import SplitExecutor
from aisyn.split.party import PartyState
from aisyn.train import checkpoint as ckpt
from aisyn.train.engine import Engine
from aisyn.train.models import BaseModel
from aisyn.train.objective import SFTObjective, sft_eval_loss
from aisyn.train.regime import Regime
from aisyn.train.run import RunDir


class ProximalSession(DataSession):
    """A data session whose step adds FedProx's proximal term for A's own
    trainable tensors (toward the global model of the round) before its
    squared norm is exchanged: the term is part of the loss A clips by."""

    anchor: dict[str, torch.Tensor] | None = None
    mu: float = 0.0

    def _sq_norm(self) -> float:
        if self.mu > 0 and self.anchor is not None:
            add_proximal_grad(self.state.named, self.anchor, self.mu)
        return super()._sq_norm()


class MemberExecutor(SplitExecutor):
    """A member's split steps; its checkpoints hold its half alone (the
    backbone is the consortium's, checkpointed once a round for all)."""

    def save(self, run: RunDir, step: int, state: dict, keep: int) -> None:
        self._write(run, step, state, keep, self.state.tensors())


@dataclass
class Member:
    """A data party of the consortium over its open session with B."""

    name: str
    node_id: int
    data: Path
    run: RunDir
    state: PartyState
    session: ProximalSession
    objective: SFTObjective
    base: BaseModel
    local_steps: int
    eval_items: int
    log_every: int = 10
    #: seconds of local training per round, and the link's bytes per round
    rounds: list[dict] = field(default_factory=list)
    #: why this party was dropped from the consortium (None: it is in)
    dropped: str | None = None

    def __post_init__(self) -> None:
        self.valid = _valid_split(self.data)
        self.executor = MemberExecutor(
            self.session, self.run.read_config()["run_id"], self.objective, self.base
        )
        # two: a run killed mid-round has this party's checkpoint of the round
        # the consortium saved even if the party saved the next one already
        self.regime = Regime(
            self.objective, self.executor, self.state.train_cfg, self.run, keep=2
        )
        self.engine = Engine(
            self.run,
            total_steps=self.state.train_cfg.steps,
            log_every=self.log_every,
            desc=f"member {self.name}",
            progress=False,
            time_key="train_s",
            log_range_edges=True,
            plot=False,
        )
        self.trainable = dict(self.state.named)
        self.spec = {n: tuple(p.shape) for n, p in self.state.named}

    def resume(self, step: int) -> None:
        """Continue from this party's checkpoint of ``step`` (the end of the
        consortium's last saved round; 0: none was saved): its optimizer,
        random state and data position, and its rounds so far. Its metrics
        lines after ``step`` are dropped (those steps are redone)."""
        if step:
            folder = ckpt.step_folder(self.run.checkpoints, step)
            if not (folder / ckpt.STATE_FILE).is_file():
                raise ckpt.CheckpointError(
                    f"party {self.name}: no checkpoint of step {step} to resume "
                    f"from in {self.run.checkpoints}"
                )
            self.regime.load(folder)
        self.run.truncate_metrics(step)
        self.rounds = [r for r in self.run.read_metrics() if "round_loss" in r]

    def drop(self, reason: str) -> None:
        """Leave the consortium for ``reason``: the session with the shared
        backbone ends (B's rounds for this party end with it)."""
        self.dropped = reason
        self.link.close()

    @property
    def link(self) -> Link:
        return self.session.link

    @property
    def examples(self) -> int:
        return len(self.objective.sources[0])

    @torch.no_grad()
    def load_global(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the global segments (checked against this member's shapes by
        the caller: ``records.record_to_tensors``)."""
        for name, p in self.trainable.items():
            p.copy_(tensors[name].to(p.device, p.dtype))

    def segments(self) -> dict[str, torch.Tensor]:
        """This member's trainable tensors, what it sends to be averaged."""
        return {n: p.detach() for n, p in self.trainable.items()}

    def valid_loss(self) -> float:
        """The loss of the model as it stands -- this member's segments and
        the shared backbone -- on its valid items (through B, as training)."""
        return sft_eval_loss(
            SplitModel(self.session),
            self.valid,
            batch_size=self.state.train_cfg.batch_size,
            max_items=self.eval_items or None,
        )

    def train_round(self, server_round: int, proximal_mu: float) -> dict:
        """Round ``server_round``'s local steps from the global segments
        (loaded already); returns the reply's metrics."""
        global_loss = self.valid_loss()
        sent0, received0 = self.link.bytes_sent, self.link.bytes_received
        self.session.mu = proximal_mu
        self.session.anchor = (
            {n: p.detach().clone() for n, p in self.trainable.items()}
            if proximal_mu > 0
            else None
        )
        first = (server_round - 1) * self.local_steps
        t0 = time.perf_counter()
        self.engine.run(self.regime, range(first, first + self.local_steps))
        train_s = time.perf_counter() - t0
        self.session.anchor = None
        losses = self.regime.losses[-self.local_steps :]
        record = {
            "round": server_round,
            "step": first + self.local_steps,
            "round_loss": sum(losses) / len(losses),
            "global_valid_loss": global_loss,
            "train_s": train_s,
            "link_bytes_sent": self.link.bytes_sent - sent0,
            "link_bytes_received": self.link.bytes_received - received0,
        }
        self.run.log_metrics(record)
        self.rounds.append(record)
        return {
            "num-examples": self.examples,
            "train-loss": record["round_loss"],
            "global-valid-loss": global_loss,
            "train-s": train_s,
            "startup-s": 0.0,
            "load-s": 0.0,
        }


def _valid_split(data: Path) -> SFTData:
    try:
        return SFTData.open(data, "valid")
    except ValueError:
        return SFTData.open(data, "train")  # no valid split: the train items' head

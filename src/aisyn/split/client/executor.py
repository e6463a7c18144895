"""The split executor: a regime's steps run as the data party of a session.

Each step is one TRAIN round with the compute party (``DataSession``): A's
front and back blocks here, the middle there, only cut-layer tensors on the
link. Validation runs through ``SplitModel`` (the middle computed by B, tokens
never leaving A). Checkpoints come in step-consistent pairs: B saves step N
first, then A, so after a crash of either side the newest step both have
exists. Under a cut defence each record carries the privacy budget spent so
far (``dp_epsilon``).

The objective (``train.objective``) is whichever the run trains: the compute
party cannot tell pre-training from fine-tuning.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from torch import nn

from aisyn.accountant import finite_or_none
from aisyn.model.segments import DATA_PARTY
from aisyn.split.client.data_party import DataSession, SplitModel
from aisyn.split.defence import cut_dp as dp
from aisyn.split.party import place_weights
from aisyn.train import checkpoint as ckpt
from aisyn.train.models import BaseModel
from aisyn.train.objective import Objective, StepBatch
from aisyn.train.regime import Executor
from aisyn.train.run import RunDir


class SplitExecutor(Executor):
    """A's side of split training over an open session."""

    def __init__(
        self,
        session: DataSession,
        run_id: str,
        objective: Objective,
        base: BaseModel | None,
    ) -> None:
        self.session, self.run_id = session, run_id
        self.objective, self.base = objective, base
        self.state = session.state
        self.link = session.link
        self.sent_total = self.received_total = 0
        self.validations = 0  # this session's: each sends every row it scores once
        self._eps: dict[int, float | None] = {}

    def step(self, step: int, batch: StepBatch) -> dict:
        sent0, recv0 = self.link.bytes_sent, self.link.bytes_received
        ts = time.perf_counter()
        result = self.session.train_step(batch, step)
        self.link.flush()
        sent = self.link.bytes_sent - sent0
        received = self.link.bytes_received - recv0
        self.sent_total += sent
        self.received_total += received
        record = {
            **result,
            **batch.record,
            "step_time_s": round(time.perf_counter() - ts, 4),
            "bytes_sent": sent,
            "bytes_received": received,
        }
        if self.session.guard is not None:
            record["dp_epsilon"] = self._epsilon(self.releases())
        return record

    def log_suffix(self, record: dict) -> str:
        return (
            f" (sent {record['bytes_sent']} B, received {record['bytes_received']} B)"
        )

    def eval_model(self) -> nn.Module:
        self.validations += 1
        return SplitModel(self.session)

    def save(self, run: RunDir, step: int, state: dict, keep: int) -> None:
        self.session.save_remote(step)  # B's half first: pairs stay consistent
        self._write(run, step, state, keep, self.state.tensors())

    def _write(self, run: RunDir, step: int, state: dict, keep: int, tensors) -> None:
        """A's half of checkpoint ``step``: ``tensors`` and the run's state."""
        ckpt.save(
            run.checkpoints,
            step,
            tensors,
            {
                "party": DATA_PARTY,
                "run_id": self.run_id,
                **state,
                "model": self.state.cfg.to_dict(),
                "partition": self.state.partition.to_dict(),
                "train": self.state.train_cfg.to_dict(),
            },
            keep=keep,
        )

    #: A's weights are in place from a private warm-up (``split.defence.warmup``): a
    #: fresh start keeps them instead of the base's
    warmed = False

    #: what a fresh start does once A's weights are in place (a trained
    #: bottleneck's calibration), if anything
    fresh_start: Callable[[], None] | None = None

    def load(self, folder: Path | None) -> dict | None:
        state = None
        if folder is not None or not self.warmed:
            state = place_weights(self.state, self.base, folder, fresh_train=True)
        if folder is None and self.fresh_start is not None:
            self.fresh_start()
        return state

    # --- the privacy budget of a cut defence -----------------------------------

    def releases(self) -> int:
        """How many times a training row may have crossed so far (each epoch
        is a permutation: once per epoch it was drawn in)."""
        s = self.objective.sampler
        return s.epoch + (1 if s.position else 0)

    def _epsilon(self, k: int) -> float | None:
        """ε of ``k`` releases (None: no finite bound); changes once an epoch."""
        if k not in self._eps:
            self._eps[k] = finite_or_none(
                dp.epsilon(
                    self.session.guard.defence,
                    k,
                    # a frozen backbone's rounds send no gradient to account
                    backward=not self.session.frozen_backbone,
                    coordinates=self._coords(),
                )
            )
        return self._eps[k]

    def _coords(self) -> int:
        return self.objective.seq_len * self.state.cfg.hidden_size

    def privacy(self) -> dict:
        """The run's privacy budget so far (``privacy.json``)."""
        defence = self.session.guard.defence
        k = self.releases()
        return {
            "defence": defence.to_dict(),
            "delta": defence.delta,
            "unit": "one training row (sequence), replaced",
            "releases_per_row": k,
            "dp_epsilon": self._epsilon(k),
            # validation rows cross forward only, once per validation
            "validations_this_session": self.validations,
            "dp_epsilon_validation_rows": finite_or_none(
                dp.epsilon(
                    defence,
                    self.validations,
                    backward=False,
                    coordinates=self._coords(),
                )
            ),
            **(
                {}
                if self.session.guard.bottleneck is None
                else {"bottleneck": self.session.guard.bottleneck.record()}
            ),
        }

    def summary(self, steps_run: int) -> dict:
        out = {
            "bytes_sent_per_step": self.sent_total / steps_run if steps_run else 0,
            "bytes_received_per_step": (
                self.received_total / steps_run if steps_run else 0
            ),
        }
        if self.session.guard is not None:
            out["privacy"] = self.privacy()
        return out

"""SCAFFOLD: control variates that correct client drift (``--strategy scaffold``).

Under non-IID data each client's local steps drift towards its own optimum,
and FedAvg's mean of drifted models lands short of the optimum of the union;
the drift grows with the local steps and the skew (Karimireddy et al., ICML
2020, who prove SCAFFOLD's rate independent of the heterogeneity and measure
it ahead of FedAvg and FedProx as the skew grows). Each client ``i`` keeps a
control variate ``c_i`` (its own gradient direction), the server keeps ``c``
(their mean), and every local step follows ``g + c - c_i``: the union's
direction instead of the client's own.

The variates here are gradients -- ``c_i`` is the mean of the raw gradients
of the client's last round -- which is the paper's option II for SGD
(``c_i - c + (x - y_i) / (K lr)`` equals that mean) and stays a gradient
under the clients' AdamW, whose steps are not ``lr x gradient``. So the
client sends ``delta c_i`` beside its model: the uplink carries two copies of
the trainable tensors, the downlink the model and ``c``.

* The client keeps ``c_i`` in its run folder (``scaffold/control-RRRRR``, one
  file per round it trained, the newest few kept: ``fl.round_files``), so a
  client is a fresh process each round and a resumed federation finds the
  variate of the round it resumes after (a round redone reads the one before
  it).
* The server: ``c <- c + |S|/N x mean(delta c_i)`` over the ``|S|`` accepted
  of the ``N`` clients asked, the mean weighed as the model's FedAvg mean is
  (by examples): the model follows the union's example-weighted loss, so
  ``c`` must be that loss's gradient. The paper weighs clients equally for
  both; a plain mean of ``c_i`` beside a weighted mean of the models would
  steer every client towards the small clients' gradients (two clients of
  45 and 48 items held half of ``c`` at the Dirichlet 0.1 deal). ``c`` is
  the strategy's state: checkpointed, restored on ``--resume``, rolled back
  with a rejected aggregate (``fl.guard``).
* The global step ``x <- x + eta_g (mean - x)`` (the paper's global learning
  rate, ``--server-lr``; 1 by default: the mean). With the drift corrected,
  each client's update is its steps along the union's direction, so
  ``eta_g`` = the number of clients adds them up as one long run would take
  them one after the other; under FedAvg the same sum overshoots, the
  updates pulling apart (measured, with SCAFFOLD's too: docs/federated.md).
* A client's ``delta c_i`` is checked as its update is (names, shapes, dtype,
  finite) and bounded the same way: one whose L2 norm exceeds
  ``max-norm-ratio`` x the round's median is rejected with its update (a
  forged variate would shift every client's next steps).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from torch import nn

from aisyn.fl.guard import lower_median, norm_bound
from aisyn.fl.records import CONTROL, UpdateRejected, decode_checked
from aisyn.fl.round_files import RoundFiles
from aisyn.train import checkpoint as ckpt

log = logging.getLogger("aisyn.fl.server")

#: the client's variates, in its run folder
CONTROLS = RoundFiles("scaffold", "control")


class Scaffold(FedAvg):
    """FedAvg's mean of the models plus the server's control variate ``c``,
    sent with the model and moved by the clients' ``delta c_i``."""

    #: ``c`` by tensor name (None until the first round: zeros)
    control: dict[str, np.ndarray] | None = None
    #: eta_g: the global model moves this many times the mean's step
    server_learning_rate: float = 1.0
    #: the round's global model, where the step starts (only when eta_g != 1)
    _start: dict[str, np.ndarray] | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ):
        if self.server_learning_rate != 1.0:
            self._start = {k: a.numpy() for k, a in arrays.items()}
        if self.control is None:
            self.control = {k: np.zeros(a.shape, np.float32) for k, a in arrays.items()}
        messages = list(super().configure_train(server_round, arrays, config, grid))
        record = ArrayRecord({k: Array(v) for k, v in self.control.items()})
        for msg in messages:
            msg.content[CONTROL] = record
        return messages

    def aggregate_train(
        self, server_round: int, replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        spec = {k: tuple(v.shape) for k, v in (self.control or {}).items()}
        deltas, kept = [], []
        for msg in replies:
            try:
                if CONTROL not in msg.content.array_records:
                    raise UpdateRejected("sent no control variate (strategy scaffold)")
                delta = decode_checked(msg.content.array_records[CONTROL], spec)
            except UpdateRejected as e:
                self._reject(server_round, msg, str(e))
                continue
            del msg.content[CONTROL]  # Flower's mean takes one ArrayRecord
            deltas.append(delta)
            kept.append(msg)
        deltas, kept = self._within_control_bound(server_round, deltas, kept)
        if not kept:
            return None, None
        arrays, metrics = super().aggregate_train(server_round, kept)
        if arrays is not None and self._start is not None:
            arrays = ArrayRecord(
                {
                    k: Array(x + self.server_learning_rate * (arrays[k].numpy() - x))
                    for k, x in self._start.items()
                }
            )
        if arrays is not None:
            asked = self._clients_asked(server_round) or len(kept)
            share = len(kept) / max(asked, len(kept))
            weights = [
                float(
                    next(iter(m.content.metric_records.values()))[self.weighted_by_key]
                )
                for m in kept
            ]
            # float64 (the float weights promote it), as the model's mean
            mean = {k: np.average([d[k] for d in deltas], 0, weights) for k in spec}
            self.control = {  # rebound, never changed in place: see fl.guard
                k: (c + share * mean[k]).astype(np.float32)
                for k, c in self.control.items()
            }
        return arrays, metrics

    def _within_control_bound(self, server_round, deltas, kept):
        """The variates within ``max-norm-ratio`` x the round's median norm."""
        norms = [
            math.sqrt(sum(float(np.vdot(v, v)) for v in d.values())) for d in deltas
        ]
        bound = norm_bound(norms, getattr(self, "max_norm_ratio", 0.0))
        if bound is None:
            return deltas, kept
        out_d, out_k = [], []
        for d, msg, norm in zip(deltas, kept, norms, strict=True):
            if norm > bound:
                self._reject(
                    server_round,
                    msg,
                    f"control variate norm {norm:.4g} exceeds {self.max_norm_ratio:g}"
                    f" x the round's median {lower_median(norms):.4g} (max-norm-ratio)",
                )
            else:
                out_d.append(d)
                out_k.append(msg)
        return out_d, out_k

    def _clients_asked(self, server_round: int) -> int | None:
        return getattr(self, "round_log", {}).get(server_round, {}).get("clients")

    def _reject(self, server_round: int, msg: Message, reason: str) -> None:
        """Drop a reply the guard had accepted, in the round's log as well."""
        node = msg.metadata.src_node_id
        log.warning(
            "round %d: rejected update from node %s: %s", server_round, node, reason
        )
        entry = getattr(self, "round_log", {}).get(server_round)
        if entry is not None:
            entry.setdefault("rejected", []).append({"node": node, "reason": reason})
            entry["accepted"] = entry.get("accepted", 1) - 1


class ControlCorrection:
    """A client's round: every step's gradient ``g`` becomes ``g + c - c_i``
    (a ``LocalExecutor`` regularizer, called between backward and the update),
    and the raw ``g`` are summed for the client's next ``c_i``."""

    def __init__(
        self,
        trainable: Sequence[tuple[str, nn.Parameter]],
        server: dict[str, torch.Tensor],
        client: dict[str, torch.Tensor],
    ) -> None:
        self.trainable = list(trainable)
        self.client = client
        self.shift = {
            n: (server[n] - client[n]).to(p.device, p.dtype) for n, p in self.trainable
        }
        self.sums = {
            n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.trainable
        }
        self.steps = 0

    @torch.no_grad()
    def __call__(self) -> dict:
        for name, p in self.trainable:
            if p.grad is None:  # no gradient reached it this step: only the shift
                p.grad = self.shift[name].clone()
                continue
            self.sums[name].add_(p.grad.float())
            p.grad.add_(self.shift[name])
        self.steps += 1
        return {}

    def new_control(self) -> dict[str, torch.Tensor]:
        """``c_i`` for the next round: the mean raw gradient of this one."""
        return {n: (s / max(self.steps, 1)).cpu() for n, s in self.sums.items()}

    def delta(self, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: new[n] - self.client[n].float().cpu() for n in new}


def load_client_control(
    out: Path, server_round: int, spec: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """The client's ``c_i`` at the start of ``server_round``: the one saved by
    the latest round before it that this client trained (zeros if none)."""
    saved = CONTROLS.read_before(out, server_round)
    if saved is None:
        return {n: torch.zeros(s) for n, s in spec.items()}
    path, tensors = saved
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    if shapes != dict(spec):
        raise ValueError(f"{path}: holds a control variate of another model")
    bad = ckpt.first_nonfinite(tensors)
    if bad is not None:
        raise ValueError(f"{path}: {bad} holds non-finite values")
    return tensors


def save_client_control(
    out: Path, server_round: int, control: dict[str, torch.Tensor]
) -> None:
    """Write ``c_i`` after ``server_round`` (atomically), keep the newest few."""
    CONTROLS.save(out, server_round, control)

"""Flower's strategies, guarded: every client update is checked before aggregation.

FedAvg, FedProx, FedAdam and FedAvgM are Flower's own
(``flwr.serverapp.strategy``); we only put ``UpdateGuard`` in front of them. It

* remembers the names and shapes of the arrays sent each round, and rejects
  (logs and drops) replies that are errors, miss or add tensors, change a shape
  or dtype, carry NaN/inf, or lack a positive sample count — Flower's own
  consistency check would otherwise raise and end the whole run;
* aggregates what is left (weighted by ``num-examples``); with nothing left it
  returns no update, and ``Strategy.start`` keeps the last good global model;
* evaluates federatedly only after the last round (each client already reports
  the loss of the global model it received, before training, in its train
  reply), and times each phase and counts payload bytes for the round log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, FedProx, Strategy

from aisyn.fl.records import (
    WEIGHT_KEY,
    WIRE_DTYPE,
    UpdateRejected,
    check_reply,
    expected_spec,
    payload_bytes,
)
from aisyn.fl.settings import FLSettings

log = logging.getLogger("aisyn.fl.server")


def as_wire_dtype(arrays: ArrayRecord) -> ArrayRecord:
    """Server optimisers compute in float64 (numpy scalars upcast); the global
    model travels, and is checked, as float32."""
    if all(a.dtype == WIRE_DTYPE for a in arrays.values()):
        return arrays
    return ArrayRecord(
        {k: Array(a.numpy().astype(np.float32)) for k, a in arrays.items()}
    )


class UpdateGuard:
    """Mixin placed before a Flower strategy class in the MRO."""

    num_rounds: int = 1

    def _guard_init(self, num_rounds: int) -> None:
        self.num_rounds = num_rounds
        self.expected: dict[str, tuple[int, ...]] = {}
        self.round_log: dict[int, dict] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.expected = expected_spec(arrays)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.round_log[server_round] = {
            "round": server_round,
            "clients": len(messages),
            "bytes_sent": len(messages) * payload_bytes(arrays),
            "t_sent": time.perf_counter(),
        }
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        t_replies = time.perf_counter()
        entry = self.round_log.setdefault(server_round, {"round": server_round})
        good, rejected = [], []
        received = 0
        for msg in replies:
            node = msg.metadata.src_node_id
            try:
                check_reply(msg, self.expected)
            except UpdateRejected as e:
                log.warning(
                    "round %d: rejected update from node %s: %s", server_round, node, e
                )
                rejected.append({"node": node, "reason": str(e)})
                continue
            received += payload_bytes(msg.content.array_records["arrays"])
            good.append(msg)
        entry.update(
            {
                "accepted": len(good),
                "rejected": rejected,
                "bytes_received": received,
                "wait_s": t_replies - entry.get("t_sent", t_replies),
            }
        )
        metrics = [m.content.metric_records["metrics"] for m in good]
        if metrics:
            weights = np.array([float(m[WEIGHT_KEY]) for m in metrics])
            for key in ("global-valid-loss", "train-loss"):
                vals = np.array([float(m[key]) for m in metrics])
                entry[key.replace("-", "_")] = float(weights @ vals / weights.sum())
            entry["client_train_s"] = max(float(m["train-s"]) for m in metrics)
            entry["client_startup_s"] = max(float(m["startup-s"]) for m in metrics)
            entry["client_load_s"] = max(float(m["load-s"]) for m in metrics)
        if not good:
            log.warning(
                "round %d: no acceptable update; keeping the last good global model",
                server_round,
            )
            entry["aggregate_s"] = 0.0
            return None, None
        t0 = time.perf_counter()
        arrays, agg_metrics = super().aggregate_train(server_round, good)
        if arrays is not None:
            arrays = as_wire_dtype(arrays)
        entry["aggregate_s"] = time.perf_counter() - t0
        if arrays is not None and not all(
            np.isfinite(a.numpy()).all() for a in arrays.values()
        ):
            log.warning(
                "round %d: aggregate is non-finite; keeping the last good global model",
                server_round,
            )
            entry["aggregate_non_finite"] = True
            return None, agg_metrics
        return arrays, agg_metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if server_round < self.num_rounds:
            return []  # train replies already carry the global model's loss
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        good = []
        for msg in replies:
            if msg.has_error():
                log.warning(
                    "round %d: evaluation failed on node %s: %s",
                    server_round,
                    msg.metadata.src_node_id,
                    msg.error.reason,
                )
                continue
            metrics = msg.content.metric_records.get("metrics")
            if metrics is None or set(metrics.keys()) != {WEIGHT_KEY, "valid-loss"}:
                log.warning(
                    "round %d: malformed evaluation reply from node %s",
                    server_round,
                    msg.metadata.src_node_id,
                )
                continue
            good.append(msg)
        return super().aggregate_evaluate(server_round, good) if good else None


class GuardedFedAvg(UpdateGuard, FedAvg):
    pass


class GuardedFedProx(UpdateGuard, FedProx):
    pass


class GuardedFedAdam(UpdateGuard, FedAdam):
    pass


class GuardedFedAvgM(UpdateGuard, FedAvgM):
    pass


def make_strategy(settings: FLSettings) -> Strategy:
    """The configured Flower strategy behind an ``UpdateGuard``."""
    n = settings.min_clients
    common = dict(
        fraction_train=1.0,
        fraction_evaluate=1.0,
        min_train_nodes=n,
        min_evaluate_nodes=n,
        min_available_nodes=n,
        weighted_by_key=WEIGHT_KEY,
    )
    if settings.strategy == "fedavg":
        strategy: UpdateGuard = GuardedFedAvg(**common)
    elif settings.strategy == "fedprox":
        strategy = GuardedFedProx(**common, proximal_mu=settings.proximal_mu)
    elif settings.strategy == "fedadam":
        strategy = GuardedFedAdam(
            **common,
            eta=settings.eta,
            eta_l=settings.lr,
            beta_1=settings.beta_1,
            beta_2=settings.beta_2,
            tau=settings.tau,
        )
    elif settings.strategy == "fedavgm":
        strategy = GuardedFedAvgM(
            **common,
            server_learning_rate=settings.server_lr,
            server_momentum=settings.server_momentum,
        )
    else:  # FLSettings validates the name; this is a programming error
        raise AssertionError(settings.strategy)
    strategy._guard_init(settings.rounds)
    return strategy  # type: ignore[return-value]

"""``UpdateGuard``: every client update checked before a Flower strategy
aggregates it. Each round it

* remembers the names and shapes of the arrays sent, and rejects (logs and
  drops) replies that are errors, miss or add tensors, change a shape or dtype,
  carry NaN/inf, or lack a whole, positive sample count — Flower's own
  consistency check would otherwise raise and end the whole run;
* counts each reply's ``num-examples`` as at most ``max-examples-ratio`` (k)
  times the round's lower median report, and at most ``max-examples`` if set
  (clamped and logged: the server cannot verify a count, and one huge count
  would otherwise make the global model that client's). Relative to the round,
  so FedAvg still weighs honest clients by their sizes (a fixed default cap
  flattened every client above it);
* rejects an update (reply minus global model) whose L2 norm exceeds
  ``max-norm-ratio`` (k) times the round's median update norm. Rejected rather
  than clipped: clipping keeps the update's direction, and a sign-flipped update
  clipped to k x the median still pulls the model back by k honest updates'
  worth; an honest client is rarely far from the others (local AdamW steps have
  similar sizes), and a rejection is visible in the round log. The median is
  the lower one, so with two clients it is the smaller norm (the mean of two
  would let a x1000 update pass at k = 3);
* aggregates what is left in float64 and checks the result: finite (in float64
  and as the float32 it travels as), not all zeros unless the model was, and
  for FedAvg / FedProx every coordinate within the clients' range (what any
  mean, median, trimmed mean or Krum selection gives; an overflowed mean does
  not). A rejected aggregate, or none at all, keeps the last good global model
  (``Strategy.start`` does that when we return no arrays), and the server
  optimiser's state (FedAdam's moments, FedAvgM's momentum) is rolled back;
* evaluates federatedly only after the last round (each client already reports
  the loss of the global model it received, before training, in its train
  reply), and times each phase and counts payload bytes for the round log.

What the bounds cannot do: with two clients nothing tells which one is honest
(a client can always stall the run by sending tiny updates, or pull the model
back by up to k honest updates); with one client there is nothing to compare
with. Robust aggregations need more clients (Krum n >= 2f + 3, Bulyan n >= 4f +
3 for f attackers); updates the norm bound rejected count as attackers already
removed, so f shrinks by them for that round.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from aisyn.fl.records import (
    CONTROL,
    WEIGHT_KEY,
    WIRE_DTYPE,
    UpdateRejected,
    check_metrics,
    check_reply,
    counted_examples,
    expected_spec,
    payload_bytes,
    round_examples_bound,
)
from aisyn.fl.settings import MEAN_STRATEGIES, FLSettings, min_updates

log = logging.getLogger("aisyn.fl.server")

# State Flower's server optimisers carry from round to round. They rebind these
# attributes every round (never change the arrays in place), so keeping the
# references is a snapshot to roll back to.
OPTIMIZER_STATE = ("current_arrays", "m_t", "v_t", "momentum_vector", "control")


def message_bytes(msg: Message) -> int:
    """What a message's arrays weigh on the wire (every ArrayRecord of it)."""
    return sum(payload_bytes(r) for r in msg.content.array_records.values())


def as_wire_dtype(arrays: ArrayRecord) -> ArrayRecord:
    """Server optimisers compute in float64 (numpy scalars upcast); the global
    model travels, and is checked, as float32."""
    if all(a.dtype == WIRE_DTYPE for a in arrays.values()):
        return arrays
    return ArrayRecord(
        {k: Array(a.numpy().astype(np.float32)) for k, a in arrays.items()}
    )


def update_norm(arrays: dict[str, np.ndarray], base: dict[str, np.ndarray]) -> float:
    """L2 norm of ``arrays - base`` over all tensors (float64: 1e30 squares fine)."""
    return math.sqrt(
        sum(float(np.square(a - base[k]).sum()) for k, a in arrays.items())
    )


def lower_median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def norm_bound(norms: list[float], ratio: float) -> float | None:
    """The largest norm accepted among ``norms``: ``ratio`` (k) times their
    lower median; None when nothing bounds them -- nothing to compare with
    (fewer than two), no bound (k = 0), or a median of zero (no information
    about a normal norm's size). The guard's rule for client updates, and
    SplitFed's for the cut tensors of a consortium's members."""
    if len(norms) < 2 or not ratio:
        return None
    median = lower_median(norms)
    return ratio * median if median > 0 else None


class UpdateGuard:
    """Mixin placed before a Flower strategy class in the MRO."""

    num_rounds: int = 1

    def _guard_init(self, settings: FLSettings) -> None:
        self.num_rounds = settings.rounds
        self.max_examples = settings.max_examples or None
        self.max_examples_ratio = settings.max_examples_ratio
        # Under client DP every client counts once: the noise is calibrated to
        # the plain mean of the sampled clients' clipped updates.
        self.uniform_weights = settings.dp != "off"
        self.train_weight = settings.update_weight  # (per step: --local-epochs)
        self.max_norm_ratio = settings.max_norm_ratio
        self.aggregation = settings.aggregation
        self.assumed_attackers = settings.assumed_attackers
        # FedAdam / FedAvgM (and SCAFFOLD at a server lr) step away from the
        # clients' mean; every other aggregate combines the updates within
        # their range, coordinate-wise.
        self.within_range = settings.strategy in MEAN_STRATEGIES or (
            settings.strategy == "scaffold" and settings.server_lr == 1.0
        )
        # what a train reply carries: the model, and SCAFFOLD's control variate
        scaffold = settings.strategy == "scaffold"
        self.reply_records = ("arrays", CONTROL) if scaffold else ("arrays",)
        self.expected: dict[str, tuple[int, ...]] = {}
        self.global_arrays: dict[str, np.ndarray] = {}
        self.round_log: dict[int, dict] = {}
        # a chunked run's grid (aisyn.fl.chunks): the updates arrive through it
        self.chunked = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.expected = expected_spec(arrays)
        self.global_arrays = {
            k: a.numpy().astype(np.float64) for k, a in arrays.items()
        }
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.round_log[server_round] = {
            "round": server_round,
            "clients": len(messages),
            "bytes_sent": sum(map(message_bytes, messages)),
            "t_sent": time.perf_counter(),
        }
        return messages

    def _round_record(self, server_round: int):
        """(the round's log entry, its rejections, ``reject(node, reason)``
        that logs one and records it)."""
        entry = self.round_log.setdefault(server_round, {"round": server_round})
        rejected: list[dict] = []

        def reject(node: int, reason: str) -> None:
            log.warning(
                "round %d: rejected update from node %s: %s", server_round, node, reason
            )
            rejected.append({"node": node, "reason": reason})

        return entry, rejected, reject

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.chunked is not None:
            return self._aggregate_chunked(server_round, list(replies))
        t_replies = time.perf_counter()
        entry, rejected, reject = self._round_record(server_round)

        updates = self._checked_updates(server_round, replies, entry, reject)
        well_formed = len(updates)
        updates = self._within_norm_bound(updates, entry, reject)
        good = [msg for msg, _ in updates]
        attackers = self._tally(
            server_round,
            entry,
            good,
            well_formed,
            rejected=rejected,
            bytes_received=entry.pop("_bytes_received", 0),
            t_replies=t_replies,
        )
        if attackers is None:
            return None, None
        # float64 from here on: the mean, FedAdam's squared steps and the checks
        lo = hi = None
        if self.within_range:
            lo, hi = _coordinate_range([arrays for _, arrays in updates])
        for msg, arrays in updates:
            msg.content["arrays"] = ArrayRecord(
                {k: Array(v) for k, v in arrays.items()}
            )
            arrays.clear()  # the Arrays hold a copy; keep the peak at one
        if hasattr(self, "num_malicious_nodes"):  # Krum, MultiKrum, Bulyan
            entry["assumed_attackers"] = self.num_malicious_nodes = attackers
        if hasattr(self, "num_nodes_to_select") and self.aggregation == "multikrum":
            self.num_nodes_to_select = max(1, len(good) - attackers)
        state = {a: getattr(self, a) for a in OPTIMIZER_STATE if hasattr(self, a)}
        t0 = time.perf_counter()
        arrays, agg_metrics = super().aggregate_train(server_round, good)
        entry["aggregate_s"] = time.perf_counter() - t0
        if arrays is None:
            return None, agg_metrics
        arrays, problem = self._wire_aggregate(arrays, lo, hi)
        if problem is not None:
            for name, value in state.items():
                setattr(self, name, value)
            _reject_aggregate(entry, server_round, problem)
            return None, agg_metrics
        return arrays, agg_metrics

    def _aggregate_chunked(
        self, server_round: int, replies: list[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """``aggregate_train`` of a chunked round (``aisyn.fl.chunks``): the
        same checks and bounds, then Flower's aggregation one chunk at a time
        over the updates the grid spilled (one chunk of each in memory)."""
        grid = self.chunked
        t_replies = time.perf_counter()
        entry, rejected, reject = self._round_record(server_round)

        checked = []
        for msg in replies:
            node = msg.metadata.src_node_id
            update = grid.updates.get(node)
            try:
                check_metrics(msg)
                counted_examples(msg.content.metric_records["metrics"][WEIGHT_KEY])
                if update is None:
                    raise UpdateRejected("sent no update chunks")
                if update.problem is not None:
                    raise UpdateRejected(update.problem)
            except UpdateRejected as e:
                reject(node, str(e))
                continue
            checked.append((msg, {}))
        checked.sort(key=lambda u: u[0].metadata.src_node_id)  # as _checked_updates
        entry["clamped"] = self._bound_weights(
            [msg for msg, _ in checked], server_round, self.uniform_weights
        )
        norms = [grid.updates[m.metadata.src_node_id].norm for m, _ in checked]
        kept = self._within_norm_bound(checked, entry, reject, norms)
        good = [msg for msg, _ in kept]
        attackers = self._tally(
            server_round,
            entry,
            good,
            len(checked),
            rejected=rejected,
            bytes_received=sum(u.bytes for u in grid.updates.values()),
            t_replies=t_replies,
            chunks=len(grid.plan),
        )
        if attackers is None:
            grid.clear()
            return None, None
        t0 = time.perf_counter()
        new = {n: np.empty(s, np.float32) for n, s in grid.spec.items()}
        agg_metrics = None
        problem = None
        for i, chunk in enumerate(grid.plan):
            parts = [
                {
                    k: v.astype(np.float64)
                    for k, v in grid.updates[m.metadata.src_node_id].chunk(i).items()
                }
                for m in good
            ]
            lo = hi = None
            if self.within_range:
                lo, hi = _coordinate_range(parts)
            for msg, arrays in zip(good, parts, strict=True):
                msg.content["arrays"] = ArrayRecord(
                    {k: Array(v) for k, v in arrays.items()}
                )
            del parts
            arrays, metrics = super().aggregate_train(server_round, good)
            agg_metrics = agg_metrics or metrics
            if arrays is None:
                problem = f"chunk {i}: nothing aggregated"
                break
            arrays, problem = self._wire_aggregate(arrays, lo, hi, whole=False)
            if problem is not None:
                problem = f"chunk {i}: {problem}"
                break
            for p in chunk:
                value = arrays[p.key].numpy()
                if p.start is None:
                    new[p.name][...] = value
                else:
                    new[p.name][p.start : p.stop] = value
        for msg in good:
            del msg.content["arrays"]
        grid.clear()
        entry["aggregate_s"] = time.perf_counter() - t0
        if problem is None:
            if not any(v.any() for v in new.values()) and any(
                g.any() for g in self.global_arrays.values()
            ):
                problem = "all zeros (overflow?)"
        if problem is not None:
            _reject_aggregate(entry, server_round, problem)
            return None, agg_metrics
        return ArrayRecord({k: Array(v) for k, v in new.items()}), agg_metrics

    def _checked_updates(
        self,
        server_round: int,
        replies: Iterable[Message],
        entry: dict,
        reject: Callable[[int, str], None],
    ) -> list[tuple[Message, dict[str, np.ndarray]]]:
        """Well-formed replies with their arrays (float64) and bounded weights."""
        out = []
        received = 0
        for msg in replies:
            node = msg.metadata.src_node_id
            try:
                arrays = check_reply(msg, self.expected, self.reply_records)
                metrics = msg.content.metric_records["metrics"]
                counted_examples(metrics[WEIGHT_KEY])  # a whole number >= 1
            except UpdateRejected as e:
                reject(node, str(e))
                continue
            received += message_bytes(msg)
            out.append((msg, {k: v.astype(np.float64) for k, v in arrays.items()}))
        # in node order: the float sums of the aggregate do not depend on the
        # order the replies arrived in (and a chunked round sums the same way)
        out.sort(key=lambda u: u[0].metadata.src_node_id)
        entry["clamped"] = self._bound_weights(
            [msg for msg, _ in out], server_round, self.uniform_weights
        )
        entry["_bytes_received"] = received
        return out

    def _bound_weights(
        self, good: list[Message], server_round: int, uniform: bool, per_step=True
    ) -> list[dict]:
        """Set each reply's ``num-examples`` to what Flower's aggregation weighs it
        by (1 each if ``uniform``; ``per_step``, a train round's update:
        ``FLSettings.update_weight``); returns the clamped ones."""
        metrics = [m.content.metric_records["metrics"] for m in good]
        if uniform:
            for m in metrics:
                m[WEIGHT_KEY] = 1
            return []
        capped = [counted_examples(m[WEIGHT_KEY], self.max_examples) for m in metrics]
        bound = round_examples_bound(capped, self.max_examples_ratio)
        clamped = []
        for msg, m, count in zip(good, metrics, capped, strict=True):
            counted = count if bound is None else min(count, bound)
            if counted != m[WEIGHT_KEY]:
                why = (
                    f"{self.max_examples_ratio:g} x the round's median report"
                    " (max-examples-ratio)"
                    if counted < count
                    else "max-examples"
                )
                log.warning(
                    "round %d: node %s reported %s %s; counted as %d (%s)",
                    server_round,
                    msg.metadata.src_node_id,
                    m[WEIGHT_KEY],
                    WEIGHT_KEY,
                    counted,
                    why,
                )
                clamped.append(
                    {
                        "node": msg.metadata.src_node_id,
                        "reported": float(m[WEIGHT_KEY]),
                        "counted": counted,
                    }
                )
            # what Flower's aggregation weighs by
            m[WEIGHT_KEY] = self.train_weight(counted) if per_step else counted
        return clamped

    def _within_norm_bound(
        self,
        updates: list[tuple[Message, dict[str, np.ndarray]]],
        entry: dict,
        reject: Callable[[int, str], None],
        norms: list[float] | None = None,
    ) -> list[tuple[Message, dict[str, np.ndarray]]]:
        """The updates within the norm bound (``norms``: theirs, when they are
        not the updates' arrays)."""
        if not updates:
            return updates
        if norms is None:
            norms = [update_norm(arrays, self.global_arrays) for _, arrays in updates]
        median = lower_median(norms)
        entry["update_norms"] = {
            str(msg.metadata.src_node_id): n
            for (msg, _), n in zip(updates, norms, strict=True)
        }
        entry["median_update_norm"] = median
        bound = norm_bound(norms, self.max_norm_ratio)
        if bound is None:
            return updates
        kept = []
        for (msg, arrays), norm in zip(updates, norms, strict=True):
            if norm > bound:
                reject(
                    msg.metadata.src_node_id,
                    f"update norm {norm:.4g} exceeds {self.max_norm_ratio:g} x the "
                    f"round's median {median:.4g} (max-norm-ratio)",
                )
            else:
                kept.append((msg, arrays))
        return kept

    def _tally(
        self,
        server_round: int,
        entry: dict,
        good: list[Message],
        well_formed: int,
        *,
        rejected: list[dict],
        bytes_received: int,
        t_replies: float,
        **extra,
    ) -> int | None:
        """Log the round's ``good`` updates (of ``well_formed`` that passed
        the checks before the norm bound) in its ``entry``, with ``extra``;
        returns how many attackers the aggregation must still tolerate, or None
        when too few updates are left to aggregate."""
        # The norm bound assumes honest updates are alike, so what it rejected
        # were attackers: the robust aggregation need tolerate only the rest
        # (else Bulyan, needing 4f + 3 updates, would skip every round in which
        # the guard dropped its attacker).
        attackers = max(0, self.assumed_attackers - (well_formed - len(good)))
        needed = min_updates(self.aggregation, attackers)
        entry.update(
            {
                "accepted": len(good),
                "rejected": rejected,
                "bytes_received": bytes_received,
                "wait_s": t_replies - entry.get("t_sent", t_replies),
                **extra,
            }
        )
        _log_client_metrics(entry, good)
        if _too_few(entry, server_round, len(good), self.aggregation, needed):
            return None
        return attackers

    def _wire_aggregate(
        self,
        arrays: ArrayRecord,
        lo: dict[str, np.ndarray] | None,
        hi: dict[str, np.ndarray] | None,
        whole: bool = True,
    ) -> tuple[ArrayRecord, str | None]:
        """The aggregate as the float32 it travels as, and why it must not
        become the global model, or None (``whole``: it is all of the model,
        not one chunk)."""
        values = {k: a.numpy() for k, a in arrays.items()}
        problem = _value_problem(values, lo, hi)
        if (
            problem is None
            and whole
            and not any(v.any() for v in values.values())
            and any(g.any() for g in self.global_arrays.values())
        ):
            problem = "all zeros (overflow?)"
        if problem is None:
            arrays = as_wire_dtype(arrays)
            if not all(np.isfinite(a.numpy()).all() for a in arrays.values()):
                problem = "the aggregate overflows float32"
        return arrays, problem

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
            node = msg.metadata.src_node_id
            if msg.has_error():
                log.warning(
                    "round %d: evaluation failed on node %s: %s",
                    server_round,
                    node,
                    msg.error.reason,
                )
                continue
            metrics = msg.content.metric_records.get("metrics")
            try:
                if metrics is None or set(metrics.keys()) != {WEIGHT_KEY, "valid-loss"}:
                    raise UpdateRejected("malformed evaluation reply")
                loss = metrics["valid-loss"]
                if isinstance(loss, list) or not math.isfinite(float(loss)):
                    raise UpdateRejected("valid-loss is not a finite number")
                counted_examples(metrics[WEIGHT_KEY])  # a whole number >= 1
            except UpdateRejected as e:
                log.warning(
                    "round %d: evaluation reply from node %s rejected: %s",
                    server_round,
                    node,
                    e,
                )
                continue
            good.append(msg)
        if not good:
            return None
        self._bound_weights(good, server_round, uniform=False, per_step=False)
        return super().aggregate_evaluate(server_round, good)


def _too_few(
    entry: dict, server_round: int, got: int, aggregation: str, needed: int
) -> bool:
    """Whether a round has too few acceptable updates (then it keeps the last
    good global model, and says so)."""
    if got >= needed:
        return False
    log.warning(
        "round %d: %d acceptable update(s), %s needs %d; keeping the last "
        "good global model",
        server_round,
        got,
        aggregation,
        needed,
    )
    entry["aggregate_s"] = 0.0
    return True


def _value_problem(
    values: dict[str, np.ndarray],
    lo: dict[str, np.ndarray] | None,
    hi: dict[str, np.ndarray] | None,
) -> str | None:
    """An aggregate's tensor with a value that is not finite or outside the
    clients' range (``lo``, ``hi``: per coordinate, when checked), or None."""
    for k, v in values.items():
        if not np.isfinite(v).all():
            return f"{k}: non-finite values"
        if lo is not None and hi is not None:
            tol = 1e-9 * np.maximum(np.abs(lo[k]), np.abs(hi[k]))
            if (v < lo[k] - tol).any() or (v > hi[k] + tol).any():
                return f"{k}: outside the range of the clients' values (overflow?)"
    return None


def _reject_aggregate(entry: dict, server_round: int, problem: str) -> None:
    """Log and record why a round's aggregate was rejected (the round keeps
    the last good global model)."""
    log.warning(
        "round %d: aggregate rejected (%s); keeping the last good global model",
        server_round,
        problem,
    )
    entry["aggregate_rejected"] = problem


def _log_client_metrics(entry: dict, good: list[Message]) -> None:
    """The clients' own numbers for the round log, weighted by counted examples."""
    metrics = [m.content.metric_records["metrics"] for m in good]
    if not metrics:
        return
    weights = np.array([float(m[WEIGHT_KEY]) for m in metrics])
    for key in ("global-valid-loss", "train-loss"):
        vals = np.array([float(m[key]) for m in metrics])
        entry[key.replace("-", "_")] = float(weights @ vals / weights.sum())
    entry["client_train_s"] = max(float(m["train-s"]) for m in metrics)
    entry["client_startup_s"] = max(float(m["startup-s"]) for m in metrics)
    entry["client_load_s"] = max(float(m["load-s"]) for m in metrics)


def _coordinate_range(
    updates: list[dict[str, np.ndarray]],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per coordinate, the smallest and largest value the clients sent."""
    lo = {k: np.minimum.reduce([u[k] for u in updates]) for k in updates[0]}
    hi = {k: np.maximum.reduce([u[k] for u in updates]) for k in updates[0]}
    return lo, hi

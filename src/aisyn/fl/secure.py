"""Secure aggregation with Flower's own SecAgg+ (the server sees only the sum).

Flower 1.42 implements SecAgg+ only for its legacy API: the server side is
``flwr.server.workflow.SecAggPlusWorkflow`` (it drives the four protocol
stages over the Grid and then hands ``FitRes`` results to a legacy
``Strategy.aggregate_fit``), the client side is the mod
``flwr.client.mod.secaggplus_mod`` (it masks the ``FitRes`` parameters the
inner handler returns). There is no Message-API variant. We use both as they
are and adapt at the two boundaries, with no cryptography of our own:

* Server: ``SecAggPlusGrid`` wraps the Grid that our (Message-API) strategy
  uses. Its ``send_and_receive`` of a round's train messages runs the
  workflow instead of one plain exchange, with a legacy strategy shim
  (``_LegacyBridge``) whose ``configure_fit`` turns our messages into
  ``FitIns`` and whose ``aggregate_fit`` receives the unmasked aggregate. It
  returns one reply per surviving client, each carrying that same aggregate
  (what the workflow itself does with legacy results), so our strategy, its
  guard and Flower's DP wrapper run unchanged: the mean of identical arrays is
  the aggregate. Only the aggregate is ever decoded on the server.
* Client: ``optional_secaggplus_mod`` runs Flower's mod on SecAgg+ messages
  only (it would fail on plain ones); ``legacy_fit_mod`` turns the legacy
  ``FitIns`` into our train message for the handler, and the handler's reply
  into the ``FitRes`` the mod masks; between them ``maskable_update_mod``
  refuses an update Flower's quantiser would turn into garbage (see below).

What travels masked is the *update* (trained minus received weights), not the
weights: SecAgg+ clips every value to ``+-clipping_range`` and quantises it to
``quantization_range`` integer levels (stochastic rounding, unbiased), and an
update is small where weights are not. With the defaults (range 1.0, 2**22
levels) one level is 4.8e-7, and the mean's error per coordinate is about that
divided by sqrt(clients): far below what a learning-rate step changes.

What an honest client sends, and what the server accepts. Flower's quantiser
clips to the range but does not stop NaN (``np.clip`` keeps it, the cast to
integers makes it an arbitrary level), so one diverged client would move the
global model by hundreds with every check passing. ``maskable_update_mod``
(every honest client runs it, before masking) refuses an update with a value
that is not finite or outside ``+-clipping_range``, or whose arrays are not
those received: the client fails the round, which SecAgg+ treats as a dropout.
A client that skips the mod can still send anything, so the server checks what
it can: a masked vector that is not the right number of integer arrays of the
right shapes is dropped (as a dropout: Flower's workflow would otherwise crash
the run adding it), and an aggregate that is not finite or outside what any
honest set of clients can produce (``aggregate_bound``) skips the round.
Weights: each update is multiplied by ``num-examples / max_weight`` before
quantising (max_weight is the largest count a reply may carry: max-examples,
else rounds x local-steps x batch-size, or 1 under DP, where every client
counts once; a client holding more counts as that, and logs it), so the
server learns only the sum of the counts. The plain path's bound relative to
the round's median report cannot apply: no count is known before masking.

A client that fails or vanishes after the setup stage is a dropout: the
protocol recovers its masks from the others' secret shares, and the round
aggregates the survivors, as long as ``threshold`` of them remain (else the
round keeps the last global model). Each stage waits at most round-timeout.

What it does not protect: the clients' metrics (losses, example counts,
timings) travel in the clear; the sum of the updates (so, with two clients,
each one's update to whoever knows the other's) and the global model are
visible to the server. SecAgg+ assumes an honest-but-curious server and
clients that follow the protocol: a client can still send any values within
the bound, and the server cannot check them one by one (hence no robust
aggregation or norm bound with it).
"""

from __future__ import annotations

import io
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.app.message_type import MessageType
from flwr.clientapp.typing import ClientAppCallable
from flwr.serverapp import Grid

from aisyn.fl.wrapped_grid import WrappedGrid

if TYPE_CHECKING:  # imported where used: the key stages' client processes
    # need neither it nor torch, and start faster without them
    from aisyn.fl.settings import FLSettings

log = logging.getLogger("aisyn.fl.secagg")

#: the legacy records the SecAgg+ workflow and mod exchange
FITINS_ARRAYS = "fitins.parameters"
FITINS_CONFIG = "fitins.config"
#: the tensor names, in the order of the legacy (unnamed) parameter list
NAMES_KEY = "aisyn-array-names"
QUANTIZATION_RANGE = 2**22  # Flower's default; the sum of 1023 clients fits
MODULUS_RANGE = 2**32  # Flower's default (the largest it allows)


def client_weight(settings: FLSettings, num_examples: int) -> int:
    """The weight a client gives its update: its example count, at most
    ``max_weight`` (logged when that bites); 1 under DP (every client counts
    once)."""
    if settings.dp != "off":
        return 1
    bound = settings.masked_examples_bound
    if num_examples > bound:
        log.warning(
            "%d training items counted as %d under secure aggregation (the "
            "largest weight: max-examples, else rounds x local-steps x "
            "batch-size); set max-examples to the largest client's items",
            num_examples,
            bound,
        )
    return max(1, min(int(num_examples), bound))


def max_weight(settings: FLSettings) -> float:
    """The largest ``client_weight`` (an update is scaled by weight / this
    before quantising, so that the weighted sum cannot overflow)."""
    return 1.0 if settings.dp != "off" else float(settings.masked_examples_bound)


def aggregate_bound(clipping_range: float, largest_weight: float) -> float:
    """The largest coordinate an aggregate of honest clients can have.

    Each honest value is within the range and is scaled by its weight ratio
    (weight / largest weight) before quantising, so the weighted mean is within
    it too, up to the quantisation: one level (2 x range / levels) per client,
    divided by the sum of the quantised ratios, which is at least one per
    client of weight >= 1.
    """
    least_ratio = max(1, round(QUANTIZATION_RANGE / largest_weight))
    return clipping_range * (1 + 2 / least_ratio)


# --- server ---------------------------------------------------------------------------


class _LegacyBridge:
    """The two ``flwr.server.strategy.Strategy`` methods the workflow calls."""

    def __init__(self, messages: list[Message]) -> None:
        self.messages = {m.metadata.dst_node_id: m for m in messages}
        self.aggregate: list[np.ndarray] | None = None
        self.results: list[tuple[int, Any]] = []

    def configure_fit(self, server_round, parameters, client_manager) -> list:
        from flwr.common import FitIns, ndarrays_to_parameters
        from flwr.server.compat.grid_client_proxy import GridClientProxy

        fit = []
        for node_id, msg in self.messages.items():
            arrays: ArrayRecord = msg.content["arrays"]  # type: ignore[assignment]
            config = dict(msg.content["config"])  # type: ignore[arg-type]
            config[NAMES_KEY] = list(arrays.keys())
            params = ndarrays_to_parameters([a.numpy() for a in arrays.values()])
            proxy = GridClientProxy(node_id, None, msg.metadata.run_id)  # type: ignore[arg-type]
            fit.append((proxy, FitIns(params, config)))
        return fit

    def aggregate_fit(self, server_round, results, failures):
        from flwr.common import parameters_to_ndarrays

        self.results = [(proxy.node_id, res) for proxy, res in results]
        if results:
            self.aggregate = parameters_to_ndarrays(results[0][1].parameters)
        return None, {}


class SecAggPlusGrid(WrappedGrid):
    """A Grid whose train rounds run Flower's SecAgg+ workflow (see the module's
    docstring); everything else passes through to ``grid``."""

    def __init__(self, grid: Grid, settings: FLSettings) -> None:
        super().__init__(grid)
        self.settings = settings
        self.last_round: dict = {}

    def handles(self, messages: list[Message]) -> bool:
        return messages[0].metadata.message_type == MessageType.TRAIN

    def exchange(self, messages: list[Message], timeout: float | None) -> list[Message]:
        """The train round as SecAgg+: one reply per surviving client, each
        carrying the unmasked aggregate."""
        from flwr.server.compat.legacy_context import LegacyContext
        from flwr.server.workflow import SecAggPlusWorkflow
        from flwr.server.workflow.constant import (
            MAIN_CONFIGS_RECORD,
            MAIN_PARAMS_RECORD,
            Key,
        )

        server_round = int(messages[0].content["config"]["server-round"])  # type: ignore[index]
        global_arrays: ArrayRecord = messages[0].content["arrays"]  # type: ignore[assignment]
        bridge = _LegacyBridge(messages)
        state = RecordDict(
            {
                MAIN_CONFIGS_RECORD: ConfigRecord({Key.CURRENT_ROUND: server_round}),
                MAIN_PARAMS_RECORD: global_arrays,
            }
        )
        context = LegacyContext(
            Context(
                run_id=messages[0].metadata.run_id,
                node_id=0,
                node_config={},
                state=state,
                run_config={},
            ),
            strategy=bridge,  # type: ignore[arg-type]
        )
        workflow = SecAggPlusWorkflow(
            num_shares=1.0,  # every sampled client holds a share of every other's
            reconstruction_threshold=self.settings.secagg_quorum,
            max_weight=max_weight(self.settings),
            clipping_range=self.settings.secagg_clipping_range,
            quantization_range=QUANTIZATION_RANGE,
            modulus_range=MODULUS_RANGE,
            timeout=timeout,
        )
        screened = _MaskedVectorScreen(self.grid, global_arrays, server_round)
        self.last_round = {"sampled": len(messages), "dropped": []}
        try:
            workflow(screened, context)  # type: ignore[arg-type]
        except (ValueError, TypeError, KeyError, IndexError) as e:
            # A reply malformed in a way no check here foresaw (a key share, a
            # public key): that round fails, not the federation.
            log.warning(
                "round %d: secure aggregation failed (%s: %s); keeping the last "
                "global model",
                server_round,
                type(e).__name__,
                e,
            )
            self.last_round["failed"] = f"{type(e).__name__}: {e}"
            return []
        survivors = [node for node, _ in bridge.results]
        dropped = sorted(set(bridge.messages) - set(survivors))
        self.last_round["dropped"] = dropped
        if screened.malformed:
            self.last_round["malformed"] = screened.malformed
        if bridge.aggregate is None:
            log.warning(
                "round %d: secure aggregation halted (fewer than %d of %d clients "
                "completed it); keeping the last global model",
                server_round,
                self.settings.secagg_quorum,
                len(messages),
            )
            self.last_round["halted"] = True
            return []
        if dropped:
            log.warning(
                "round %d: %d client(s) dropped out of secure aggregation (nodes "
                "%s); aggregated the other %d",
                server_round,
                len(dropped),
                dropped,
                len(survivors),
            )
        if problem := self._aggregate_problem(bridge.aggregate):
            log.warning(
                "round %d: secure aggregate rejected (%s; a client sent values "
                "no honest client sends); keeping the last global model",
                server_round,
                problem,
            )
            self.last_round["aggregate_rejected"] = problem
            return []
        # The workflow's aggregate is the weighted mean of the masked updates:
        # add it to the global model, float64, then the wire's float32.
        aggregate = ArrayRecord(
            {
                name: Array((a.numpy().astype(np.float64) + delta).astype(np.float32))
                for (name, a), delta in zip(
                    global_arrays.items(), bridge.aggregate, strict=True
                )
            }
        )
        replies = []
        for node, fitres in bridge.results:
            metrics = MetricRecord(dict(fitres.metrics))
            content = RecordDict({"arrays": aggregate, "metrics": metrics})
            replies.append(Message(content, reply_to=bridge.messages[node]))
        return replies

    def _aggregate_problem(self, aggregate: list[np.ndarray]) -> str | None:
        """Why the unmasked aggregate cannot be honest clients' mean, or None."""
        bound = aggregate_bound(
            self.settings.secagg_clipping_range, max_weight(self.settings)
        )
        for i, delta in enumerate(aggregate):
            if not np.isfinite(delta).all():
                return f"array {i}: non-finite values"
            if delta.size and (largest := float(np.abs(delta).max())) > bound:
                return (
                    f"array {i}: a coordinate of {largest:.4g} exceeds {bound:.4g}, "
                    "the most secagg-clipping-range allows"
                )
        return None


class _MaskedVectorScreen(WrappedGrid):
    """The Grid the SecAgg+ workflow talks through: a masked vector that is not
    the integer arrays of the shapes an honest client sends is dropped, so the
    workflow treats its client as a dropout (adding it would raise, ending the
    run, or garble the sum)."""

    def __init__(self, grid: Grid, arrays: ArrayRecord, server_round: int) -> None:
        super().__init__(grid)
        self.server_round = server_round
        # the weight ratio (one integer), then one array per tensor
        self.shapes = [(1,)] + [tuple(a.shape) for a in arrays.values()]
        self.malformed: list[int] = []

    def handles(self, messages: list[Message]) -> bool:
        return True  # every stage's exchange: only the masked vectors are screened

    def exchange(self, messages: list[Message], timeout: float | None) -> list[Message]:
        kept = []
        for reply in self.grid.send_and_receive(messages, timeout=timeout):
            problem = None if reply.has_error() else self._problem(reply)
            if problem is None:
                kept.append(reply)
                continue
            node = reply.metadata.src_node_id
            log.warning(
                "round %d: dropped node %s from secure aggregation: %s",
                self.server_round,
                node,
                problem,
            )
            self.malformed.append(node)
        return kept

    def _problem(self, reply: Message) -> str | None:
        from flwr.common import bytes_to_ndarray
        from flwr.common.secure_aggregation.secaggplus_constants import (
            RECORD_KEY_CONFIGS,
            Key,
        )

        configs = reply.content.config_records.get(RECORD_KEY_CONFIGS)
        if configs is None or Key.MASKED_PARAMETERS not in configs:
            return None  # another stage's reply
        blobs = configs[Key.MASKED_PARAMETERS]
        if not isinstance(blobs, list) or len(blobs) != len(self.shapes):
            n = len(blobs) if isinstance(blobs, list) else type(blobs).__name__
            return f"masked vector of {n} arrays, expected {len(self.shapes)}"
        for i, (blob, shape) in enumerate(zip(blobs, self.shapes, strict=True)):
            try:
                arr = bytes_to_ndarray(blob)  # np.load(allow_pickle=False)
            except (ValueError, TypeError, OSError, EOFError) as e:
                return f"masked array {i}: undecodable ({e})"
            if arr.shape != shape or arr.dtype.kind not in "iu":
                return (
                    f"masked array {i}: {arr.dtype}{list(arr.shape)}, expected "
                    f"integers{list(shape)}"
                )
        return None


# --- client ---------------------------------------------------------------------------


def optional_secaggplus_mod(
    msg: Message, ctxt: Context, call_next: ClientAppCallable
) -> Message:
    """Flower's ``secaggplus_mod`` on SecAgg+ messages; others pass by."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import (
        RECORD_KEY_CONFIGS,
    )

    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


def legacy_fit_mod(
    msg: Message, ctxt: Context, call_next: ClientAppCallable
) -> Message:
    """The SecAgg+ workflow's ``FitIns`` in, our train message to the handler;
    its reply out as the ``FitRes`` (the update, its weight, the metrics) that
    ``secaggplus_mod`` masks."""
    content = msg.content
    if FITINS_ARRAYS not in content.array_records:
        return call_next(msg, ctxt)
    from flwr.common import (
        Code,
        FitRes,
        Status,
        ndarrays_to_parameters,
        parameters_to_ndarrays,
    )
    from flwr.compat.common.recorddict_compat import (
        arrayrecord_to_parameters,
        fitres_to_recorddict,
    )

    config = dict(content.config_records[FITINS_CONFIG])
    names = [str(n) for n in config.pop(NAMES_KEY)]  # type: ignore[union-attr]
    received = parameters_to_ndarrays(
        arrayrecord_to_parameters(content.array_records[FITINS_ARRAYS], True)
    )
    if len(names) != len(received):
        raise ValueError(f"{len(received)} arrays for {len(names)} names")
    msg.content = RecordDict(
        {
            "arrays": ArrayRecord(
                {n: Array(a) for n, a in zip(names, received, strict=True)}
            ),
            "config": ConfigRecord(config),  # type: ignore[arg-type]
        }
    )
    reply = call_next(msg, ctxt)
    if reply.has_error():
        return reply
    from aisyn.fl.settings import FLSettings

    settings = FLSettings.from_run_config(config)  # type: ignore[arg-type]
    sent: ArrayRecord = reply.content["arrays"]  # type: ignore[assignment]
    metrics = dict(reply.content["metrics"])  # type: ignore[arg-type]
    update = [
        sent[n].numpy().astype(np.float64) - r.astype(np.float64)
        for n, r in zip(names, received, strict=True)
    ]
    fitres = FitRes(
        Status(Code.OK, ""),
        ndarrays_to_parameters(update),
        client_weight(settings, int(metrics["num-examples"])),
        metrics,  # type: ignore[arg-type]
    )
    return Message(fitres_to_recorddict(fitres, False), reply_to=msg)


def maskable_update_mod(
    msg: Message, ctxt: Context, call_next: ClientAppCallable
) -> Message:
    """Refuse (raise, so the client drops out of the round) an update that
    SecAgg+'s quantiser cannot carry faithfully: arrays other than those
    received, a value that is not finite or outside the protocol's clipping
    range, or a weight above its largest. Runs between ``secaggplus_mod`` and
    ``legacy_fit_mod``, on the masked-vector stage only."""
    if FITINS_ARRAYS not in msg.content.array_records:
        return call_next(msg, ctxt)
    from flwr.common import parameters_to_ndarrays
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE
    from flwr.compat.common.recorddict_compat import recorddict_to_fitres

    # what was received, before legacy_fit_mod replaces the message's content
    shapes = [
        npy_shape(a.data) for a in msg.content.array_records[FITINS_ARRAYS].values()
    ]
    protocol = ctxt.state.config_records[RECORD_KEY_STATE]  # the setup stage's
    limit = float(protocol["clipping_range"])  # type: ignore[arg-type]
    largest_weight = float(protocol["max_weight"])  # type: ignore[arg-type]
    reply = call_next(msg, ctxt)
    if reply.has_error():
        return reply
    fitres = recorddict_to_fitres(reply.content, keep_input=True)
    update = parameters_to_ndarrays(fitres.parameters)
    problem = update_problem(update, shapes, limit)
    if problem is None and not 0 <= fitres.num_examples <= largest_weight:
        problem = f"weight {fitres.num_examples} outside [0, {largest_weight:g}]"
    if problem is not None:
        raise ValueError(f"update refused before masking: {problem}")
    return reply


def npy_shape(blob: bytes) -> tuple[int, ...]:
    """The shape in a legacy parameter's ``np.save`` header (the legacy
    ``ArrayRecord`` holds raw bytes; decoding them would copy the model)."""
    f = io.BytesIO(blob)
    version = np.lib.format.read_magic(f)
    read = (
        np.lib.format.read_array_header_1_0
        if version == (1, 0)
        else np.lib.format.read_array_header_2_0
    )
    return tuple(read(f)[0])


def update_problem(
    update: list[np.ndarray], shapes: list[tuple[int, ...]], limit: float
) -> str | None:
    """Why ``update`` cannot be masked as is, or None."""
    if len(update) != len(shapes):
        return f"{len(update)} arrays, {len(shapes)} received"
    for i, (u, shape) in enumerate(zip(update, shapes, strict=True)):
        if u.shape != shape:
            return f"array {i} has shape {list(u.shape)}, received {list(shape)}"
        if not np.isfinite(u).all():
            return f"array {i} has non-finite values"
        if u.size and (largest := float(np.abs(u).max())) > limit:
            return (
                f"array {i} has a coordinate of {largest:.4g}, beyond "
                f"secagg-clipping-range {limit:g} (raise it)"
            )
    return None


def optional_fixedclipping_mod(
    msg: Message, ctxt: Context, call_next: ClientAppCallable
) -> Message:
    """Flower's ``fixedclipping_mod`` on train messages whose config carries a
    clipping norm (``--dp client``); others pass by."""
    from flwr.clientapp.mod import fixedclipping_mod
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

    config = msg.content.config_records.get("config")
    if (
        msg.metadata.message_type == MessageType.TRAIN
        and config is not None
        and KEY_CLIPPING_NORM in config
    ):
        return fixedclipping_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)

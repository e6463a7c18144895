"""Secure aggregation against clients that send what no honest client sends.

Flower's real SecAgg+ (the server workflow behind ``SecAggPlusGrid``, the
client mods of ``aisyn.fl.client_app``, its key agreement, masks and secret
shares) runs over an in-process grid of three nodes whose train handler is
cheap: it returns the received weights plus a fixed update, so what the
server must end with is known exactly. One node misbehaves:

* it diverged (NaN) but runs the honest mods: it must refuse to mask, and the
  others' mean stand;
* it skips the honest check (a malicious client) and sends NaN or values far
  beyond the clipping range: the unmasked aggregate is then garbage, which the
  server must refuse, keeping the last global model;
* it sends a masked vector of the wrong length: that node is dropped, not the
  run ended (Flower's workflow raised adding it);
* it sends key shares that are not shares: the round fails, not the run.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flower_fakes import FakeGrid, metrics
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common.serde import message_from_proto, message_to_proto

from aisyn.fl.client_app import MODS
from aisyn.fl.secure import (
    SecAggPlusGrid,
    maskable_update_mod,
    update_problem,
)
from aisyn.fl.settings import FLSettings
from aisyn.fl.strategy import make_strategy

pytestmark = pytest.mark.usefixtures("task_identity")

GLOBAL = {"w": np.array([0.5, -0.5, 0.25], np.float32), "b": np.zeros(2, np.float32)}
#: each honest node's update (node id: update of every tensor), well inside +-1
UPDATES = {
    1: {"w": [0.01, 0.02, -0.03], "b": [0.001, 0.0]},
    2: {"w": [0.03, -0.02, 0.01], "b": [0.0, -0.002]},
    3: {"w": [-0.02, 0.01, 0.02], "b": [0.003, 0.001]},
}
EXAMPLES = {1: 10, 2: 30, 3: 20}
BAD = 3


def settings(**kw) -> FLSettings:
    # batch 1 x 1 step x 100 rounds: max-examples is 100, above every count
    return FLSettings.from_dict(
        dict(rounds=100, local_steps=1, batch_size=1, min_clients=3)
        | dict(secure_aggregation=True, round_timeout=60)
        | kw
    )


def trainer(update: dict[str, list[float]], node: int, mods=MODS) -> ClientApp:
    """A ClientApp with ``mods`` (the shipped ones) whose training adds ``update``."""
    app = ClientApp(mods=list(mods))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        received = msg.content["arrays"]
        sent = ArrayRecord(
            {
                k: Array(a.numpy() + np.asarray(update[k], np.float32))
                for k, a in received.items()
            }
        )
        content = RecordDict({"arrays": sent, "metrics": metrics(EXAMPLES[node])})
        return Message(content, reply_to=msg)

    return app


#: the shipped mods without the honest client's update check (a malicious client)
UNCHECKED = [m for m in MODS if m is not maskable_update_mod]


def truncate_mod(msg, ctxt, call_next):
    """A client whose masked vector lacks its last array."""
    from flwr.common.secure_aggregation.secaggplus_constants import (
        RECORD_KEY_CONFIGS,
        Key,
    )

    reply = call_next(msg, ctxt)
    configs = reply.content.config_records.get(RECORD_KEY_CONFIGS)
    if configs is not None and Key.MASKED_PARAMETERS in configs:
        configs[Key.MASKED_PARAMETERS] = configs[Key.MASKED_PARAMETERS][:-1]
    return reply


def wire(msg: Message) -> Message:
    return message_from_proto(message_to_proto(msg))


class InProcessGrid(FakeGrid):
    """Every node a ClientApp in this process, its context kept between the
    protocol's stages; messages cross as their wire form (as over the
    SuperLink: each side has its own copy), and a raising ClientApp answers
    with an error, as Flower's ``flwr-clientapp`` does."""

    def __init__(self, apps: dict[int, ClientApp]) -> None:
        super().__init__(list(apps))
        self.apps = apps
        self.contexts = {n: Context(1, n, {}, RecordDict(), {}) for n in apps}

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            msg = wire(msg)
            try:
                replies.append(wire(self.apps[node](msg, self.contexts[node])))
            except Exception as e:  # noqa: BLE001 - what the runtime does
                replies.append(
                    Message(Error(2, f"{type(e).__name__}: {e}"), reply_to=msg)
                )
        return replies


def run_round(s: FLSettings, apps: dict[int, ClientApp]):
    """One secure round: (the new global arrays or None, the round's SecAgg+ log)."""
    strategy = make_strategy(s)
    record = ArrayRecord({k: Array(v) for k, v in GLOBAL.items()})
    config = ConfigRecord(s.to_run_config())
    sent = strategy.configure_train(1, record, config, FakeGrid(list(apps)))
    secure = SecAggPlusGrid(InProcessGrid(apps), s)
    replies = list(secure.send_and_receive(sent))
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays, secure.last_round


def weighted_mean(nodes) -> dict[str, np.ndarray]:
    total = sum(EXAMPLES[n] for n in nodes)
    return {
        k: GLOBAL[k]
        + sum(EXAMPLES[n] * np.asarray(UPDATES[n][k]) for n in nodes) / total
        for k in GLOBAL
    }


def assert_global(arrays, expected, s: FLSettings) -> None:
    level = 2 * s.secagg_clipping_range / 2**22
    for k, v in expected.items():
        np.testing.assert_allclose(arrays[k].numpy(), v, atol=20 * level + 1e-6)


def honest_apps() -> dict[int, ClientApp]:
    return {n: trainer(UPDATES[n], n) for n in UPDATES}


def test_honest_clients_aggregate_to_their_weighted_mean():
    s = settings()
    arrays, log = run_round(s, honest_apps())
    assert log["dropped"] == [] and "aggregate_rejected" not in log
    assert_global(arrays, weighted_mean([1, 2, 3]), s)


@pytest.mark.parametrize("bad_value", [np.nan, np.inf, 5.0])
def test_an_honest_client_refuses_to_mask_a_bad_update(bad_value):
    # Prepare: node 3's training diverged (or overshot the clipping range of 1)
    s = settings()
    apps = honest_apps()
    apps[BAD] = trainer({"w": [0.0, bad_value, 0.0], "b": [0.0, 0.0]}, BAD)
    # Execute
    arrays, log = run_round(s, apps)
    # Assert: it dropped out, and the global model is the other two's mean
    assert log["dropped"] == [BAD]
    assert_global(arrays, weighted_mean([1, 2]), s)


@pytest.mark.parametrize(
    ("bad_value", "dp"), [(np.nan, "off"), (np.nan, "client"), (1e6, "off")]
)
def test_a_client_skipping_the_check_cannot_move_the_model(bad_value, dp, caplog):
    # Prepare: node 3 sends NaN (or 10^6) without the honest check. Flower's
    # quantiser turns NaN into an arbitrary level; 10^6 it clips to the range
    # *after* scaling by the weight ratio (0.2; 1 under DP). Client DP (which
    # clips each update's norm in an inner mod) does not stop either.
    s = settings(dp=dp, dp_noise_multiplier=0.0, dp_clipping_norm=10.0)
    apps = honest_apps()
    apps[BAD] = trainer({"w": [bad_value] * 3, "b": [0.0, 0.0]}, BAD, UNCHECKED)
    # Execute
    with caplog.at_level(logging.WARNING, "aisyn.fl.secagg"):
        arrays, log = run_round(s, apps)
    # Assert: the round is refused with one clear line, the model unchanged
    assert arrays is None
    assert (
        "exceeds" in log["aggregate_rejected"]
        or "non-finite" in log["aggregate_rejected"]
    )
    [line] = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert line.startswith("round 1: secure aggregate rejected (array 0: ")
    assert line.endswith("keeping the last global model")


def test_what_the_bound_lets_a_client_do():
    """Under DP every weight ratio is 1, so Flower's clip of 10^6 to the range
    gives a value an honest client may send: accepted, and it moves each
    coordinate by at most range / clients."""
    s = settings(dp="client", dp_noise_multiplier=0.0, dp_clipping_norm=1e9)
    apps = honest_apps()
    apps[BAD] = trainer({"w": [1e6] * 3, "b": [0.0, 0.0]}, BAD, UNCHECKED)
    arrays, _ = run_round(s, apps)
    honest = {k: sum(np.asarray(UPDATES[n][k]) for n in (1, 2)) for k in GLOBAL}
    moved = arrays["w"].numpy() - GLOBAL["w"] - honest["w"] / 3
    np.testing.assert_allclose(moved, s.secagg_clipping_range / 3, atol=1e-5)


def test_a_wrong_length_masked_vector_drops_that_client_not_the_run():
    # Prepare: node 3's masked vector lacks an array (Flower's workflow raised
    # "operands could not be broadcast together" adding it)
    s = settings()
    apps = honest_apps()
    apps[BAD] = trainer(UPDATES[BAD], BAD, [truncate_mod, *MODS])
    # Execute
    arrays, log = run_round(s, apps)
    # Assert: dropped as a dropout (its masks recovered), the others aggregated
    assert log["malformed"] == [BAD] and log["dropped"] == [BAD]
    assert_global(arrays, weighted_mean([1, 2]), s)


def test_update_problem_names_each_defect():
    shapes = [(2,), (1,)]
    ok = [np.zeros(2), np.zeros(1)]
    assert update_problem(ok, shapes, 1.0) is None
    assert "2 arrays" in update_problem(ok, [(2,), (1,), (3,)], 1.0)
    assert "shape [3]" in update_problem([np.zeros(3), np.zeros(1)], shapes, 1.0)
    assert "non-finite" in update_problem(
        [np.zeros(2), np.array([np.nan])], shapes, 1.0
    )
    assert "secagg-clipping-range 1" in update_problem(
        [np.zeros(2), np.array([-1.5])], shapes, 1.0
    )


def garbage_shares_mod(msg, ctxt, call_next):
    """A client whose key shares (the unmask stage) are not shares at all."""
    from flwr.common.secure_aggregation.secaggplus_constants import (
        RECORD_KEY_CONFIGS,
        Key,
    )

    reply = call_next(msg, ctxt)
    configs = reply.content.config_records.get(RECORD_KEY_CONFIGS)
    if configs is not None and Key.SHARE_LIST in configs:
        configs[Key.SHARE_LIST] = [b"\x01"] * len(configs[Key.SHARE_LIST])
    return reply


def test_a_protocol_failure_skips_the_round_not_the_run(caplog):
    s = settings()
    apps = honest_apps()
    apps[BAD] = trainer(UPDATES[BAD], BAD, [garbage_shares_mod, *MODS])
    with caplog.at_level(logging.WARNING, "aisyn.fl.secagg"):
        arrays, log = run_round(s, apps)
    # Assert: Flower's unmasking raised (the run used to end); the round is
    # skipped with one line, the model unchanged
    assert arrays is None
    assert log["failed"].startswith("ValueError: ")
    [line] = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert line.startswith("round 1: secure aggregation failed (ValueError: ")


def test_a_client_above_the_largest_masked_weight_says_so(caplog):
    """Under SecAgg+ each client scales its own update before any count is
    known, so the fixed largest weight still applies there, and bites loudly."""
    from aisyn.fl.secure import client_weight, max_weight

    s = settings()  # 100 rounds x 1 step x batch 1: the largest weight is 100
    assert max_weight(s) == 100
    with caplog.at_level(logging.WARNING, "aisyn.fl.secagg"):
        assert client_weight(s, 60) == 60
        assert not caplog.records
        assert client_weight(s, 8683) == 100
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("8683 training items counted as 100 under secure aggreg")
    assert client_weight(settings(max_examples=9000), 8683) == 8683

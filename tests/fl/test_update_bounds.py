"""Magnitude checks: sample counts, update norms, and the aggregate itself.

Each test is one of the attacks that the format checks let through: a client that
claims a huge ``num-examples``, an update with huge (but finite) values or a
scaled, sign-flipped one, a FedAdam server that one such update freezes, and an
aggregate that overflowed to all zeros.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flower_fakes import FakeGrid, configured, reply_to
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from aisyn.fl.settings import FLSettings
from aisyn.fl.strategy import make_strategy

pytestmark = pytest.mark.usefixtures("task_identity")

# rounds x local-steps x batch-size = 24: the old fixed cap of every count
SMALL_RUN = dict(rounds=2, local_steps=3, batch_size=4, min_clients=2)


def test_honest_clients_keep_their_fedavg_weights():
    # Prepare: two honest domains of 8 683 and 3 670 items (the comparison's
    # parts), far above the 24 items a client trains on in this run; they used
    # to be clamped at 24 each, so FedAvg weighed them equally
    s = make_strategy(FLSettings.from_dict(SMALL_RUN))
    sent = configured(s, {"w": [0.0, 0.0]})
    replies = [
        reply_to(sent[1], {"w": [1.0, 1.0]}, n=8683),
        reply_to(sent[2], {"w": [-1.0, 2.0]}, n=3670),
    ]
    # Execute
    arrays, _ = s.aggregate_train(1, replies)
    # Assert: FedAvg's example-weighted mean; nothing clamped
    expected = (8683 * np.array([1.0, 1.0]) + 3670 * np.array([-1.0, 2.0])) / 12353
    np.testing.assert_allclose(arrays["w"].numpy(), expected, rtol=1e-6)
    assert s.round_log[1]["clamped"] == []


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox"])
@pytest.mark.parametrize("claimed", [1e12, 2**62])
def test_a_huge_num_examples_counts_as_k_times_the_rounds_median(
    strategy, claimed, caplog
):
    # Prepare: three honest clients of 20, 30 and 25 items, a liar claiming
    # `claimed`; the lower median of the four reports is 25
    s = make_strategy(FLSettings.from_dict({"strategy": strategy, **SMALL_RUN}))
    sent = configured(s, {"w": [0.0, 0.0]}, nodes=(1, 2, 3, 4))
    sizes = {1: 20, 2: 30, 3: 25}
    updates = {1: [1.0, 1.0], 2: [1.0, 0.5], 3: [0.5, 1.0], 4: [-1.0, 2.0]}
    replies = [reply_to(sent[n], {"w": updates[n]}, n=sizes[n]) for n in sizes]
    replies.append(reply_to(sent[4], {"w": updates[4]}, n=claimed))
    # Execute
    with caplog.at_level(logging.WARNING, "aisyn.fl.server"):
        arrays, _ = s.aggregate_train(1, replies)
    # Assert: the liar counts 4 x 25 = 100 (max-examples-ratio 4), the honest
    # clients their sizes; logged as clamped, with the setting named
    counted = {**sizes, 4: 100}
    expected = sum(counted[n] * np.array(updates[n]) for n in counted) / 175
    np.testing.assert_allclose(arrays["w"].numpy(), expected, rtol=1e-6)
    [clamped] = s.round_log[1]["clamped"]
    assert clamped["node"] == 4 and clamped["counted"] == 100
    [line] = [r.getMessage() for r in caplog.records if "counted as" in r.getMessage()]
    assert line.endswith(
        "counted as 100 (4 x the round's median report (max-examples-ratio))"
    )


def test_with_two_clients_a_liar_counts_at_most_k_honest_ones():
    s = make_strategy(FLSettings.from_dict(SMALL_RUN))
    sent = configured(s, {"w": [0.0]})
    replies = [
        reply_to(sent[1], {"w": [1.0]}, n=20),
        reply_to(sent[2], {"w": [2.0]}, n=1e12),
    ]
    arrays, _ = s.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), [(20 + 2 * 80) / 100])


def test_a_max_examples_ratio_of_0_turns_the_round_bound_off():
    s = make_strategy(FLSettings.from_dict({"max_examples_ratio": 0, **SMALL_RUN}))
    sent = configured(s, {"w": [0.0]})
    replies = [
        reply_to(sent[1], {"w": [1.0]}, n=10),
        reply_to(sent[2], {"w": [2.0]}, n=990),
    ]
    arrays, _ = s.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), [1.99])


def test_a_configured_max_examples_is_the_bound():
    s = make_strategy(FLSettings.from_dict({"max_examples": 100, **SMALL_RUN}))
    sent = configured(s, {"w": [0.0]})
    replies = [
        reply_to(sent[1], {"w": [1.0]}, n=100),
        reply_to(sent[2], {"w": [2.0]}, n=10**9),
    ]
    arrays, _ = s.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), [1.5])  # equal weights
    [clamped] = s.round_log[1]["clamped"]
    assert clamped["counted"] == 100


def test_two_clients_at_1e308_examples_do_not_zero_the_model():
    # Prepare: their weights overflowed the sum, so every weight became 0
    s = make_strategy(FLSettings.from_dict(SMALL_RUN))
    sent = configured(s, {"w": [0.5, 0.5]})
    replies = [
        reply_to(sent[1], {"w": [1.0, 2.0]}, n=1e308),
        reply_to(sent[2], {"w": [3.0, 2.0]}, n=1e308),
    ]
    # Execute
    arrays, _ = s.aggregate_train(1, replies)
    # Assert: both count the same (MAX_COUNTED), so the plain mean
    np.testing.assert_allclose(arrays["w"].numpy(), [2.0, 2.0])


def test_a_fractional_num_examples_is_rejected():
    s = make_strategy(FLSettings.from_dict(SMALL_RUN))
    sent = configured(s, {"w": [0.0]})
    arrays, _ = s.aggregate_train(
        1,
        [
            reply_to(sent[1], {"w": [1.0]}, n=3),
            reply_to(sent[2], {"w": [9.0]}, n=2.5),
        ],
    )
    np.testing.assert_allclose(arrays["w"].numpy(), [1.0])
    [rejected] = s.round_log[1]["rejected"]
    assert "whole number" in rejected["reason"]


HONEST = {"w": [1.0, -1.0, 0.5], "b": [0.25]}  # the update is these minus zeros


def scaled(update: dict, factor: float) -> dict:
    return {k: [factor * x for x in v] for k, v in update.items()}


@pytest.mark.parametrize(
    "attack",
    [
        {"w": [1e30, 1e30, -1e30], "b": [1e30]},  # finite, so the format checks pass
        scaled(HONEST, -1000.0),  # sign-flipped x1000
    ],
    ids=["1e30-values", "sign-flipped-x1000"],
)
@pytest.mark.parametrize("honest_clients", [1, 2])
def test_an_update_far_beyond_the_rounds_median_norm_is_rejected(
    attack, honest_clients
):
    # Prepare: honest clients send (slightly different) updates of norm ~1.6
    s = make_strategy(FLSettings(min_clients=1))  # default k = 3
    nodes = tuple(range(1, honest_clients + 2))
    sent = configured(s, {"w": [0.0, 0.0, 0.0], "b": [0.0]}, nodes=nodes)
    honest = [
        reply_to(sent[i], scaled(HONEST, 1 + 0.1 * i), n=10)
        for i in range(1, honest_clients + 1)
    ]
    attacker = reply_to(sent[nodes[-1]], attack, n=10)
    # Execute
    arrays, _ = s.aggregate_train(1, [*honest, attacker])
    # Assert: the attacker is left out (with its norm in the reason); honest count
    log = s.round_log[1]
    [rejected] = log["rejected"]
    assert rejected["node"] == nodes[-1] and "median" in rejected["reason"]
    assert log["accepted"] == honest_clients
    w = arrays["w"].numpy()
    assert np.all(np.abs(w) < 2) and w[0] > 0  # moved the honest way


def test_updates_within_k_times_the_median_all_count():
    # Prepare: honest spread 1x, 1.5x, 2.5x with k = 3; the median is 1.5x
    s = make_strategy(FLSettings(min_clients=3))  # default k = 3
    sent = configured(s, {"w": [0.0, 0.0, 0.0], "b": [0.0]}, nodes=(1, 2, 3))
    replies = [
        reply_to(sent[i], scaled(HONEST, f), n=10)
        for i, f in zip((1, 2, 3), (1.0, 1.5, 2.5), strict=True)
    ]
    # Execute
    arrays, _ = s.aggregate_train(1, replies)
    # Assert: none rejected; the round log has every norm and the median
    log = s.round_log[1]
    assert log["accepted"] == 3 and log["rejected"] == []
    norm = float(np.sqrt(1 + 1 + 0.25 + 0.0625))
    assert log["median_update_norm"] == pytest.approx(1.5 * norm, rel=1e-6)
    np.testing.assert_allclose(arrays["w"].numpy(), [5 / 3, -5 / 3, 5 / 6], rtol=1e-6)


def test_with_two_clients_the_smaller_norm_is_the_reference():
    """The plain median of two norms is their mean, which a x1000 update drags to
    500x; the lower median is the honest client's norm."""
    s = make_strategy(FLSettings(min_clients=2))  # default k = 3
    sent = configured(s, {"w": [0.0]})
    replies = [
        reply_to(sent[1], {"w": [1.0]}, n=1),
        reply_to(sent[2], {"w": [5.0]}, n=1),  # 5x: above k = 3
    ]
    s.aggregate_train(1, replies)
    assert [r["node"] for r in s.round_log[1]["rejected"]] == [2]


def test_a_norm_ratio_of_zero_turns_the_bound_off():
    s = make_strategy(FLSettings(min_clients=2, max_norm_ratio=0.0))
    sent = configured(s, {"w": [0.0]})
    replies = [
        reply_to(sent[1], {"w": [1.0]}, n=1),
        reply_to(sent[2], {"w": [1000.0]}, n=1),
    ]
    arrays, _ = s.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), [500.5])


def test_fedadam_keeps_moving_a_tensor_after_a_1e30_update():
    # Prepare: round 1: an honest client and one sending 1e30 values
    s = make_strategy(FLSettings(strategy="fedadam", eta=0.1, min_clients=2))
    sent = configured(s, {"w": [0.0, 0.0]})
    a1, _ = s.aggregate_train(
        1,
        [
            reply_to(sent[1], {"w": [1.0, -1.0]}, n=5),
            reply_to(sent[2], {"w": [1e30, 1e30]}, n=5),
        ],
    )
    # Execute: round 2, two honest updates in the same direction
    g1 = a1["w"].numpy()
    sent2 = configured(s, {"w": g1}, server_round=2)
    a2, _ = s.aggregate_train(
        2,
        [
            reply_to(sent2[1], {"w": g1 + [1.0, -1.0]}, n=5),
            reply_to(sent2[2], {"w": g1 + [1.0, -1.0]}, n=5),
        ],
    )
    # Assert: the second moment stayed finite and small, and w kept moving
    assert all(np.isfinite(v).all() and v.max() < 10 for v in s.v_t.values())
    step = a2["w"].numpy() - g1
    assert step[0] > 0.01 and step[1] < -0.01


def _fake_mean(result: dict):
    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        arrays = {k: Array(np.asarray(v, dtype=np.float64)) for k, v in result.items()}
        return ArrayRecord(arrays), None

    return aggregate_train


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox"])
def test_an_aggregate_outside_the_clients_range_is_caught(monkeypatch, strategy):
    """The overflow symptom: an all-zero model that passes the finiteness check."""
    # Prepare: the inner mean returns zeros although every client sent ~1
    s = make_strategy(FLSettings(strategy=strategy, min_clients=2))
    sent = configured(s, {"w": [0.5, 0.5]})
    monkeypatch.setattr(FedAvg, "aggregate_train", _fake_mean({"w": [0.0, 0.0]}))
    replies = [
        reply_to(sent[1], {"w": [1.0, 1.0]}, n=3),
        reply_to(sent[2], {"w": [1.2, 0.9]}, n=3),
    ]
    # Execute
    arrays, _ = s.aggregate_train(1, replies)
    # Assert: no new global model; the round log says why
    assert arrays is None
    assert "outside" in s.round_log[1]["aggregate_rejected"]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf / inf
@pytest.mark.parametrize(
    "strategy, state", [("fedadam", ("m_t", "v_t")), ("fedavgm", ("momentum_vector",))]
)
def test_a_rejected_aggregate_leaves_the_server_optimizer_untouched(
    monkeypatch, strategy, state
):
    # Prepare: one good round, then an inner mean that is infinite
    s = make_strategy(
        FLSettings(strategy=strategy, eta=0.1, server_momentum=0.5, min_clients=1)
    )
    sent = configured(s, {"w": [0.0]}, nodes=(1,))
    a1, _ = s.aggregate_train(1, [reply_to(sent[1], {"w": [1.0]}, n=1)])
    before = {k: getattr(s, k) for k in state}
    sent2 = configured(s, {"w": a1["w"].numpy()}, nodes=(1,), server_round=2)
    monkeypatch.setattr(FedAvg, "aggregate_train", _fake_mean({"w": [np.inf]}))
    # Execute
    a2, _ = s.aggregate_train(2, [reply_to(sent2[1], {"w": [2.0]}, n=1)])
    # Assert: round 2 keeps the last model, and the optimizer's state is round 1's
    assert a2 is None
    for k in state:
        assert getattr(s, k) is before[k], k


def test_evaluation_loss_is_a_mean_with_bounded_weights():
    # Prepare: the final evaluation (round 2 of 2); both claim 1e308 items
    s = make_strategy(FLSettings.from_dict(SMALL_RUN))
    msgs = s.configure_evaluate(2, ArrayRecord(), ConfigRecord(), FakeGrid([1, 2]))
    replies = [
        Message(
            RecordDict({"metrics": MetricRecord({"num-examples": n, "valid-loss": v})}),
            reply_to=m,
        )
        for m, n, v in zip(msgs, (1e308, 1e308), (2.0, 4.0), strict=True)
    ]
    # Execute
    out = s.aggregate_evaluate(2, replies)
    # Assert: equal (bounded) weights, not an overflowed 0/0
    assert out["valid-loss"] == pytest.approx(3.0)

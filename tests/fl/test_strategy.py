"""Aggregation: FedAvg is the weighted mean; bad updates are rejected, not fatal."""

from __future__ import annotations

import numpy as np
import pytest
from flower_fakes import configured, metrics, record, reply_to
from flwr.app import Array, ArrayRecord, Message, RecordDict

from aisyn.fl.records import CONTROL, tensors_to_record
from aisyn.fl.settings import FLSettings
from aisyn.fl.strategy import make_strategy

pytestmark = pytest.mark.usefixtures("task_identity")


def with_control(msg: Message, delta: dict) -> Message:
    msg.content[CONTROL] = record(delta)
    return msg


def test_fedavg_of_two_clients_is_the_hand_computed_weighted_mean():
    # Prepare
    strategy = make_strategy(FLSettings(strategy="fedavg", min_clients=2))
    sent = configured(strategy, {"w": [0.0, 0.0], "b": [0.0]})
    replies = [
        reply_to(sent[1], {"w": [1.0, 2.0], "b": [3.0]}, n=30),
        reply_to(sent[2], {"w": [5.0, -2.0], "b": [-1.0]}, n=10),
    ]
    # Execute
    arrays, _ = strategy.aggregate_train(1, replies)
    # Assert: (30 * client1 + 10 * client2) / 40, by hand
    np.testing.assert_allclose(arrays["w"].numpy(), [2.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(arrays["b"].numpy(), [2.0], rtol=1e-6)
    log = strategy.round_log[1]
    assert log["accepted"] == 2 and log["rejected"] == []
    assert log["bytes_sent"] == log["bytes_received"]  # 2 x the same payload size


@pytest.mark.parametrize("strategy", ["fedavg", "scaffold"])
def test_under_local_epochs_an_update_counts_by_its_examples_per_step(strategy):
    # Prepare: 0.4 epochs of batch 4: 300 items take 30 steps a round, 100
    # take 10; the step each client took weighs alike (not 300 : 100)
    settings = FLSettings.from_dict(
        {"strategy": strategy, "min_clients": 2, "local_epochs": 0.4, "batch_size": 4}
    )
    strategy = make_strategy(settings)
    sent = configured(strategy, {"w": [0.0, 0.0], "b": [0.0]})
    replies = [
        reply_to(sent[1], {"w": [1.0, 2.0], "b": [3.0]}, n=300),
        reply_to(sent[2], {"w": [5.0, -2.0], "b": [-1.0]}, n=100),
    ]
    if settings.strategy == "scaffold":
        zero = {"w": [0.0, 0.0], "b": [0.0]}
        replies = [with_control(r, zero) for r in replies]
    # Execute
    arrays, _ = strategy.aggregate_train(1, replies)
    # Assert: (300/30 x client1 + 100/10 x client2) / 20: the plain mean
    np.testing.assert_allclose(arrays["w"].numpy(), [3.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(arrays["b"].numpy(), [1.0], rtol=1e-6)


@pytest.mark.parametrize(
    "bad, reason",
    [
        ({"w": [np.nan, 1.0], "b": [0.0]}, "non-finite"),
        ({"w": [1.0, 1.0, 1.0], "b": [0.0]}, "expected float32"),
        ({"w": [1.0, 1.0]}, "names differ"),
        ({"w": [1.0, 1.0], "b": [0.0], "extra": [9.0]}, "names differ"),
    ],
)
def test_corrupted_update_is_rejected_and_the_rest_aggregated(bad, reason):
    # Prepare
    strategy = make_strategy(FLSettings(strategy="fedavg", min_clients=2))
    sent = configured(strategy, {"w": [0.0, 0.0], "b": [0.0]})
    good = reply_to(sent[1], {"w": [1.0, 2.0], "b": [3.0]}, n=5)
    corrupt = reply_to(sent[2], bad, n=1000)
    # Execute
    arrays, _ = strategy.aggregate_train(1, [good, corrupt])
    # Assert: only the good update counts, the bad one is logged with its reason
    np.testing.assert_allclose(arrays["w"].numpy(), [1.0, 2.0])
    [rejected] = strategy.round_log[1]["rejected"]
    assert reason in rejected["reason"]


def test_update_whose_header_lies_about_its_shape_is_rejected():
    # Prepare: header says (2,), payload holds 3 values
    strategy = make_strategy(FLSettings(strategy="fedavg", min_clients=1))
    sent = configured(strategy, {"w": [0.0, 0.0]}, nodes=(1,))
    real = Array(np.zeros(3, dtype=np.float32))
    lying = Array(dtype="float32", shape=(2,), stype=real.stype, data=real.data)
    msg = Message(
        RecordDict({"arrays": ArrayRecord({"w": lying}), "metrics": metrics(4)}),
        reply_to=sent[1],
    )
    # Execute
    arrays, metrics_out = strategy.aggregate_train(1, [msg])
    # Assert: nothing acceptable, so no new global model (the last good one stays)
    assert arrays is None and metrics_out is None
    assert "header" in strategy.round_log[1]["rejected"][0]["reason"]


def test_bad_metrics_and_error_replies_are_rejected():
    strategy = make_strategy(FLSettings(strategy="fedprox", min_clients=2))
    sent = configured(strategy, {"w": [0.0]})
    zero_weight = reply_to(sent[1], {"w": [1.0]}, n=0)
    nan_loss = reply_to(sent[2], {"w": [1.0]}, n=3, **{"train-loss": float("nan")})
    arrays, _ = strategy.aggregate_train(1, [zero_weight, nan_loss])
    assert arrays is None
    reasons = [r["reason"] for r in strategy.round_log[1]["rejected"]]
    assert any("positive" in r for r in reasons) and any("finite" in r for r in reasons)


def test_fedavgm_applies_server_momentum_on_top_of_the_mean():
    # Prepare: two rounds with the same client update; momentum 0.5, server lr 1
    strategy = make_strategy(
        FLSettings(strategy="fedavgm", server_momentum=0.5, min_clients=1)
    )
    g0 = {"w": [0.0]}
    sent = configured(strategy, g0, nodes=(1,))
    a1, _ = strategy.aggregate_train(1, [reply_to(sent[1], {"w": [1.0]}, n=1)])
    # Execute: round 2 starts from a1 = 1.0, the client again moves by +1
    sent2 = configured(strategy, {"w": a1["w"].numpy()}, nodes=(1,))
    a2, _ = strategy.aggregate_train(2, [reply_to(sent2[1], {"w": [2.0]}, n=1)])
    # Assert: pseudo-gradient -1 both rounds; momentum v2 = 0.5 * -1 + -1 = -1.5
    np.testing.assert_allclose(a1["w"].numpy(), [1.0])
    np.testing.assert_allclose(a2["w"].numpy(), [2.5])


def test_bf16_tensors_travel_as_float32():
    import torch

    rec = tensors_to_record({"x": torch.ones(3, dtype=torch.bfloat16)})
    assert rec["x"].dtype == "float32"
    np.testing.assert_array_equal(rec["x"].numpy(), np.ones(3, dtype=np.float32))


def test_fedadam_global_model_stays_float32_and_moves_toward_the_clients():
    from aisyn.fl.records import decode_checked, expected_spec

    # Prepare
    strategy = make_strategy(FLSettings(strategy="fedadam", eta=0.1, min_clients=1))
    sent = configured(strategy, {"w": [0.0, 0.0]}, nodes=(1,))
    # Execute
    arrays, _ = strategy.aggregate_train(
        1, [reply_to(sent[1], {"w": [1.0, -1.0]}, n=2)]
    )
    # Assert: float32 (servers optimisers compute in float64), checked like an update
    assert arrays["w"].dtype == "float32"
    w = decode_checked(arrays, expected_spec(arrays))["w"]
    assert w[0] > 0 > w[1]

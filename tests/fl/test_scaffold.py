"""SCAFFOLD (``--strategy scaffold``): the client's correction of each gradient,
its control variate kept between rounds, the server's ``c`` moved by the
accepted clients' variates, and the variates checked like the updates.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flower_fakes import configured, record, reply_to
from flwr.app import Message

from aisyn.fl.records import CONTROL, payload_bytes
from aisyn.fl.scaffold import (
    ControlCorrection,
    load_client_control,
    save_client_control,
)
from aisyn.fl.settings import FLSettings
from aisyn.fl.strategy import make_strategy

SMALL_RUN = dict(rounds=2, local_steps=3, batch_size=4, min_clients=2)


def with_control(msg: Message, delta: dict) -> Message:
    msg.content[CONTROL] = record(delta)
    return msg


# -- the client ---------------------------------------------------------------


def test_each_gradient_is_corrected_by_c_minus_c_i_and_c_i_becomes_its_mean():
    # Prepare: one parameter, the server's c and the client's own c_i
    w = torch.nn.Parameter(torch.zeros(3))
    c = {"w": torch.tensor([1.0, 0.0, -1.0])}
    c_i = {"w": torch.tensor([0.5, 0.5, 0.5])}
    correction = ControlCorrection([("w", w)], c, c_i)
    raw = [torch.tensor([2.0, 4.0, 6.0]), torch.tensor([0.0, -2.0, 2.0])]
    # Execute: two steps, each as the executor calls it (after backward)
    seen = []
    for g in raw:
        w.grad = g.clone()
        correction()
        seen.append(w.grad.clone())
    new = correction.new_control()
    # Assert: g + c - c_i on every step; the next c_i is the raw gradients' mean
    for g, s in zip(raw, seen, strict=True):
        torch.testing.assert_close(s, g + c["w"] - c_i["w"])
    torch.testing.assert_close(new["w"], torch.tensor([1.0, 1.0, 4.0]))
    torch.testing.assert_close(correction.delta(new)["w"], new["w"] - c_i["w"])


def test_a_client_finds_the_variate_of_the_round_before_and_keeps_the_newest(
    tmp_path,
):
    spec = {"w": (2,)}
    # nothing saved: zeros (the paper's start)
    assert torch.equal(load_client_control(tmp_path, 1, spec)["w"], torch.zeros(2))
    for r in range(1, 6):
        save_client_control(tmp_path, r, {"w": torch.full((2,), float(r))})
    # round 5 redone (a resumed federation) reads round 4's, not its own
    assert load_client_control(tmp_path, 5, spec)["w"].tolist() == [4.0, 4.0]
    assert load_client_control(tmp_path, 9, spec)["w"].tolist() == [5.0, 5.0]
    kept = sorted(p.name for p in (tmp_path / "scaffold").iterdir())
    assert kept == [f"control-{r:05d}.safetensors" for r in (3, 4, 5)]


@pytest.mark.parametrize("damage", ["truncated", "other-model", "nan"])
def test_a_damaged_client_variate_is_refused_in_one_line(tmp_path, damage):
    spec = {"w": (2,)}
    if damage == "other-model":
        save_client_control(tmp_path, 1, {"w": torch.zeros(3)})
    elif damage == "nan":
        save_client_control(tmp_path, 1, {"w": torch.tensor([0.0, float("nan")])})
    else:
        save_client_control(tmp_path, 1, {"w": torch.zeros(2)})
        path = tmp_path / "scaffold" / "control-00001.safetensors"
        path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError) as e:
        load_client_control(tmp_path, 2, spec)
    assert "control-00001" in str(e.value) and "\n" not in str(e.value)


# -- the server ---------------------------------------------------------------


@pytest.mark.usefixtures("task_identity")
def test_the_server_sends_c_and_moves_it_by_the_mean_delta():
    # Prepare
    s = make_strategy(FLSettings.from_dict({**SMALL_RUN, "strategy": "scaffold"}))
    sent = configured(s, {"w": [0.0, 0.0]})
    for m in sent.values():  # c starts at zeros
        assert m.content[CONTROL]["w"].numpy().tolist() == [0.0, 0.0]
    replies = [
        with_control(reply_to(sent[1], {"w": [1.0, 1.0]}, n=30), {"w": [2.0, 0.0]}),
        with_control(reply_to(sent[2], {"w": [-1.0, 3.0]}, n=10), {"w": [0.0, 4.0]}),
    ]
    # Execute
    arrays, _ = s.aggregate_train(1, replies)
    # Assert: the model is FedAvg's weighted mean, and c the deltas' mean
    # weighed the same (30 : 10), not their plain mean (1, 2)
    np.testing.assert_allclose(arrays["w"].numpy(), [0.5, 1.5])
    np.testing.assert_allclose(s.control["w"], [1.5, 1.0])
    assert s.round_log[1]["accepted"] == 2
    # the next round carries the new c, and its bytes count in the round log
    sent = configured(s, {"w": [0.5, 1.5]}, server_round=2)
    assert sent[1].content[CONTROL]["w"].numpy().tolist() == [1.5, 1.0]
    one = payload_bytes(record({"w": [0.0, 0.0]}))
    assert s.round_log[2]["bytes_sent"] == 2 * 2 * one  # 2 clients, 2 records each


@pytest.mark.usefixtures("task_identity")
def test_a_server_lr_moves_the_global_model_that_many_times_the_mean_step():
    # Prepare: eta_g 2 from x = (1, -1); the clients' weighted mean is
    # (0.5, 1.5) as above
    settings = {**SMALL_RUN, "strategy": "scaffold", "server_lr": 2.0}
    s = make_strategy(FLSettings.from_dict(settings))
    sent = configured(s, {"w": [1.0, -1.0]})
    replies = [
        with_control(reply_to(sent[1], {"w": [1.0, 1.0]}, n=30), {"w": [2.0, 0.0]}),
        with_control(reply_to(sent[2], {"w": [-1.0, 3.0]}, n=10), {"w": [0.0, 4.0]}),
    ]
    # Execute
    arrays, _ = s.aggregate_train(1, replies)
    # Assert: x + 2 (mean - x), beyond both clients' 3.0 on w[1] (a mean's
    # range check would refuse it); c moves as at eta_g 1
    np.testing.assert_allclose(arrays["w"].numpy(), [0.0, 4.0])
    assert arrays["w"].numpy().dtype == np.float32
    np.testing.assert_allclose(s.control["w"], [1.5, 1.0])
    assert "aggregate_rejected" not in s.round_log[1]


@pytest.mark.usefixtures("task_identity")
def test_a_missing_forged_or_outsized_variate_rejects_its_reply(caplog):
    # Prepare: four clients; 1 and 2 honest, 3 sends no variate, 4 a NaN one,
    # 5 one a hundred times the others' (a forged c would steer every client)
    s = make_strategy(
        FLSettings.from_dict({**SMALL_RUN, "strategy": "scaffold", "min_clients": 2})
    )
    sent = configured(s, {"w": [0.0, 0.0]}, nodes=(1, 2, 3, 4, 5))
    honest = {"w": [1.0, 1.0]}
    replies = [
        with_control(reply_to(sent[1], honest, n=10), {"w": [1.0, 0.0]}),
        with_control(reply_to(sent[2], honest, n=10), {"w": [0.0, 1.0]}),
        reply_to(sent[3], honest, n=10),
        with_control(reply_to(sent[4], honest, n=10), {"w": [np.nan, 0.0]}),
        with_control(reply_to(sent[5], honest, n=10), {"w": [100.0, 0.0]}),
    ]
    # Execute
    with caplog.at_level(logging.WARNING, "aisyn.fl.server"):
        arrays, _ = s.aggregate_train(1, replies)
    # Assert: only 1 and 2 count; c moves by 2/5 of their mean delta
    entry = s.round_log[1]
    reasons = {r["node"]: r["reason"] for r in entry["rejected"]}
    assert set(reasons) == {3, 4, 5} and entry["accepted"] == 2
    assert "ArrayRecords" in reasons[3] and "non-finite" in reasons[4]
    assert "control variate norm" in reasons[5]
    np.testing.assert_allclose(s.control["w"], [0.2, 0.2])
    np.testing.assert_allclose(arrays["w"].numpy(), [1.0, 1.0])


@pytest.mark.usefixtures("task_identity")
def test_a_rejected_aggregate_rolls_c_back():
    # Prepare: a first good round moves c
    s = make_strategy(FLSettings.from_dict({**SMALL_RUN, "strategy": "scaffold"}))
    sent = configured(s, {"w": [0.0, 0.0]})
    s.aggregate_train(
        1,
        [
            with_control(reply_to(sent[n], {"w": [1.0, 1.0]}, n=5), {"w": [1.0, 1.0]})
            for n in (1, 2)
        ],
    )
    before = s.control
    # Execute: a round whose aggregate is all zeros (an overflow's signature)
    sent = configured(s, {"w": [1.0, 1.0]}, server_round=2)
    arrays, _ = s.aggregate_train(
        2,
        [
            with_control(reply_to(sent[n], {"w": [0.0, 0.0]}, n=5), {"w": [3.0, 3.0]})
            for n in (1, 2)
        ],
    )
    # Assert
    assert arrays is None and s.round_log[2]["aggregate_rejected"]
    assert s.control is before


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"secure_aggregation": True}, "secure aggregation"),
        ({"max_message_mb": 1.0}, "max-message-mb 0"),
        ({"dp": "client", "max_norm_ratio": 0}, "strategy fedavg or fedprox"),
        ({"aggregation": "median"}, "not scaffold"),
    ],
)
def test_what_scaffold_cannot_ride_with_is_refused_in_one_line(overrides, says):
    with pytest.raises(ValueError, match=says) as e:
        FLSettings.from_dict({**SMALL_RUN, "strategy": "scaffold", **overrides})
    assert "\n" not in str(e.value)

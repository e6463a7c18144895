"""Robust aggregation (setting ``aggregation``): Flower's own strategies, guarded.

Five clients, one of them an attacker whose update is large but inside the norm
bound (k = 3 x the median), so only the aggregation stands between it and the
global model.
"""

from __future__ import annotations

import numpy as np
import pytest
from flower_fakes import configured, reply_to
from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg, Krum, MultiKrum

from aisyn.fl.guard import UpdateGuard
from aisyn.fl.settings import FLSettings
from aisyn.fl.strategy import make_strategy

pytestmark = pytest.mark.usefixtures("task_identity")

HONEST = [[1.0, 2.0], [1.2, 1.8], [0.8, 2.2], [1.1, 2.1]]  # updates around (1, 2)
ATTACK = [-2.5, -5.0]  # sign-flipped, 2.5x: passes max-norm-ratio 3


def run_round(aggregation: str, honest=HONEST, attack=ATTACK, **kw):
    n = len(honest) + (attack is not None)
    s = make_strategy(FLSettings(aggregation=aggregation, min_clients=n, **kw))
    sent = configured(s, {"w": [0.0, 0.0]}, nodes=tuple(range(1, n + 1)))
    updates = [*honest, attack] if attack is not None else honest
    replies = [
        reply_to(sent[i], {"w": u}, n=10)
        for i, u in zip(range(1, n + 1), updates, strict=True)
    ]
    arrays, _ = s.aggregate_train(1, replies)
    return s, (None if arrays is None else arrays["w"].numpy())


@pytest.mark.parametrize(
    "aggregation, flower_class",
    [
        ("trimmed-mean", FedTrimmedAvg),
        ("median", FedMedian),
        ("krum", Krum),
        ("multikrum", MultiKrum),
        ("bulyan", Bulyan),
    ],
)
def test_each_aggregation_is_flowers_strategy_behind_the_guard(
    aggregation, flower_class
):
    s = make_strategy(FLSettings(aggregation=aggregation, min_clients=7))
    assert isinstance(s, UpdateGuard) and isinstance(s, flower_class)


def test_the_mean_is_pulled_back_by_an_attacker_inside_the_norm_bound():
    # the baseline the robust aggregations improve on
    _, w = run_round("mean")
    np.testing.assert_allclose(w, np.mean([*HONEST, ATTACK], axis=0), rtol=1e-6)
    assert w[1] < 1.0  # less than half of the honest step


def test_median_is_the_coordinate_wise_median():
    _, w = run_round("median")
    np.testing.assert_allclose(w, [1.0, 2.0], rtol=1e-6)


def test_trimmed_mean_cuts_the_extremes_of_each_coordinate():
    # trim 0.2 of 5 = one value from each tail, per coordinate
    _, w = run_round("trimmed-mean", trim_fraction=0.2)
    np.testing.assert_allclose(w, [(1.0 + 1.1 + 0.8) / 3, (2.0 + 1.8 + 2.1) / 3])


def test_krum_picks_one_honest_update():
    _, w = run_round("krum")
    assert any(np.allclose(w, h) for h in HONEST)


def test_multikrum_averages_all_but_the_assumed_attacker():
    _, w = run_round("multikrum", assumed_attackers=1)
    np.testing.assert_allclose(w, np.mean(HONEST, axis=0), rtol=1e-6)


@pytest.mark.heavy
def test_bulyan_stays_among_the_honest_updates():
    honest = [*HONEST, [0.9, 1.9], [1.05, 2.05]]  # 6 honest + 1: n >= 4f + 3
    _, w = run_round("bulyan", honest=honest)
    lo, hi = np.min(honest, axis=0), np.max(honest, axis=0)
    assert np.all(w >= lo) and np.all(w <= hi)


def test_too_few_accepted_updates_for_krum_keep_the_last_model():
    # Prepare: krum with f = 1 needs 2f + 3 = 5 updates; 2 of 5 are malformed
    # (a malformed reply may be a crash, so f stays 1)
    s = make_strategy(FLSettings(aggregation="krum", min_clients=5))
    sent = configured(s, {"w": [0.0, 0.0]}, nodes=(1, 2, 3, 4, 5))
    replies = [reply_to(sent[i], {"w": HONEST[i - 1]}, n=10) for i in range(1, 4)]
    replies += [reply_to(sent[i], {"w": [np.nan, 0.0]}, n=10) for i in (4, 5)]
    # Execute
    arrays, _ = s.aggregate_train(1, replies)
    # Assert: 3 left: no new global model
    assert arrays is None
    assert s.round_log[1]["accepted"] == 3


@pytest.mark.heavy
def test_bulyan_still_aggregates_once_the_guard_rejected_the_attacker():
    """7 clients meet Bulyan's guarantee (n >= 4f + 3). The norm bound drops a
    x1000 update; that was the attacker, so Bulyan aggregates the 6 left with
    f = 0 (with f = 1 Flower's Bulyan would skip: 6 < 7)."""
    honest = [*HONEST, [0.9, 1.9], [1.05, 2.05]]
    s, w = run_round("bulyan", honest=honest, attack=[-1000.0, -2000.0])
    log = s.round_log[1]
    assert log["accepted"] == 6 and len(log["rejected"]) == 1
    assert log["assumed_attackers"] == 0
    lo, hi = np.min(honest, axis=0), np.max(honest, axis=0)
    assert w is not None and np.all(w >= lo) and np.all(w <= hi)


def test_fedprox_clients_can_use_a_robust_aggregation():
    s = make_strategy(
        FLSettings(strategy="fedprox", aggregation="median", min_clients=3)
    )
    assert isinstance(s, FedMedian)

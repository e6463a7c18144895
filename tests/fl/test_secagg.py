"""Secure aggregation with Flower's SecAgg+ through the deployment runtime.

The server sees only the sum of the updates; the global model must be what
plain FedAvg makes of the same clients' updates, up to SecAgg+'s quantisation,
and a client dropping out mid-round must leave the survivors' mean.

Every client saves the local model it sent (``OUT/clients/NAME``), so FedAvg's
aggregate (the mean of those, weighted by counted examples) is known exactly.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from one_round import one_round, weights

from aisyn.data.sft import SFTData
from aisyn.fl.launch import simulate
from aisyn.fl.secure import QUANTIZATION_RANGE


def counted(result: dict, sft_dirs: dict[str, Path]) -> dict[str, int]:
    bound = result["settings"]["max_examples"]
    return {n: min(len(SFTData.open(d, "train")), bound) for n, d in sft_dirs.items()}


def fedavg(run: Path, counts: dict[str, int]) -> dict[str, np.ndarray]:
    """FedAvg's aggregate of the clients' local models: their weighted mean."""
    models = {n: weights(run / "clients" / n) for n in counts}
    total = sum(counts.values())
    return {
        k: sum(counts[n] * models[n][k] for n in counts) / total
        for k in next(iter(models.values()))
    }


def quantisation_tolerance(result: dict, counts: dict[str, int]) -> float:
    """The most SecAgg+'s quantisation moves a coordinate of the weighted mean:
    one level (2 x range / levels) per client, over the sum of the weight
    ratios (counts / max-examples), plus float32 rounding of the weights."""
    settings = result["settings"]
    ratios = [c / settings["max_examples"] for c in counts.values()]
    level = 2 * settings["secagg_clipping_range"] / QUANTIZATION_RANGE
    return len(ratios) * level / sum(ratios) + 1e-6


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


@pytest.mark.slow  # the default suite runs secure aggregation end to end with a dropout
def test_secagg_aggregate_equals_fedavg_up_to_quantisation(
    base_run, sft_dirs, tmp_path
):
    # Execute
    run = tmp_path / "run"
    result = simulate(base_run, sft_dirs, run, one_round(secure_aggregation=True))
    # Assert: both clients' updates were aggregated, none was seen alone
    [h] = result["history"]
    assert h["accepted"] == 2
    assert h["secure_aggregation"] == {"sampled": 2, "dropped": []}
    assert result["privacy"]["secure_aggregation"] is True
    counts = counted(result, sft_dirs)
    expected = fedavg(run, counts)
    tol = quantisation_tolerance(result, counts)
    # training moved the model far more than the quantisation can
    assert max_diff(expected, weights(base_run)) > 100 * tol
    assert max_diff(weights(run / "server"), expected) <= tol


@pytest.mark.heavy
def test_a_client_dropping_out_mid_round_leaves_the_survivors_mean(
    base_run, sft_dirs, tmp_path
):
    """A third client passes SecAgg+'s key stages, then its training fails (its
    data vanished): the protocol recovers its masks from the others' shares, and
    the round ends promptly with the mean of the two survivors' updates."""
    # Prepare: threshold 2 of 3, so one dropout is tolerated
    clients = {**sft_dirs, "dropout": tmp_path / "no-such-data"}
    settings = one_round(secure_aggregation=True, min_clients=3)
    assert settings.secagg_quorum == 2
    run = tmp_path / "run"
    # Execute
    t0 = time.perf_counter()
    result = simulate(base_run, clients, run, settings, validate=False)
    elapsed = time.perf_counter() - t0
    # Assert: one node dropped, the other two aggregated, with no timeout waited
    [h] = result["history"]
    assert h["accepted"] == 2
    assert h["secure_aggregation"]["sampled"] == 3
    assert len(h["secure_aggregation"]["dropped"]) == 1
    assert h["round_s"] < settings.round_timeout
    assert elapsed < 2 * settings.round_timeout
    counts = counted(result, sft_dirs)
    expected = fedavg(run, counts)
    assert max_diff(weights(run / "server"), expected) <= quantisation_tolerance(
        result, counts
    )


@pytest.mark.slow
def test_secagg_global_model_equals_a_plain_fedavg_run(base_run, sft_dirs, tmp_path):
    """The same round without secure aggregation (same seed) ends at the same
    global model, up to the quantisation."""
    plain = simulate(base_run, sft_dirs, tmp_path / "plain", one_round())
    secure = simulate(
        base_run, sft_dirs, tmp_path / "secure", one_round(secure_aggregation=True)
    )
    tol = quantisation_tolerance(secure, counted(plain, sft_dirs))
    diff = max_diff(
        weights(tmp_path / "secure" / "server"), weights(tmp_path / "plain" / "server")
    )
    assert diff <= tol

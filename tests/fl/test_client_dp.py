"""Client-level DP with Flower's fixed-clipping wrappers, and its reported ε."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
from one_round import one_round, weights

from aisyn.accountant import epsilon
from aisyn.fl.launch import simulate
from aisyn.train.run import read_metrics


def client_updates(run: Path, base: dict, names) -> list[dict[str, np.ndarray]]:
    """Each client's update: the local model it trained minus the global one."""
    return [
        {k: v - base[k] for k, v in weights(run / "clients" / n).items()} for n in names
    ]


def clipped(update: dict[str, np.ndarray], norm: float) -> dict[str, np.ndarray]:
    size = math.sqrt(sum(float(np.square(v).sum()) for v in update.values()))
    return {k: v * min(1.0, norm / size) for k, v in update.items()}


def reference_epsilon(noise: float, q: float, rounds: int, delta: float) -> float:
    event = dp_event.GaussianDpEvent(noise)
    if q < 1:
        event = dp_event.PoissonSampledDpEvent(q, event)
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(event, rounds)
    return accountant.get_epsilon(delta)


def test_epsilon_is_the_rdp_accountants():
    assert epsilon(1.1, 1.0, 5, 1e-5) == reference_epsilon(1.1, 1.0, 5, 1e-5)
    assert epsilon(1.1, 0.5, 5, 1e-5) == reference_epsilon(1.1, 0.5, 5, 1e-5)
    assert epsilon(1.1, 0.5, 5, 1e-5) < epsilon(1.1, 1.0, 5, 1e-5)  # amplification
    assert epsilon(0.0, 1.0, 5, 1e-5) == math.inf and epsilon(1.0, 1.0, 0, 1e-5) == 0


@pytest.mark.heavy
def test_client_dp_clips_on_clients_adds_calibrated_noise_and_reports_epsilon(
    base_run, sft_dirs, tmp_path
):
    # Prepare: a clipping norm below the updates' norms, so every one is clipped
    noise, clip = 1.0, 0.05
    settings = one_round(dp="client", dp_noise_multiplier=noise, dp_clipping_norm=clip)
    run = tmp_path / "run"
    # Execute
    result = simulate(base_run, sft_dirs, run, settings)
    # Assert: ε as the accountant has it, in the summary and the round log
    want = reference_epsilon(noise, 1.0, 1, settings.dp_delta)
    privacy = result["privacy"]
    assert privacy["epsilon"] == want and privacy["delta"] == 1e-5
    [entry] = [m for m in read_metrics(run / "server" / "metrics.jsonl") if "step" in m]
    assert entry["epsilon"] == want
    assert (
        json.loads((run / "server" / "result.json").read_text())["privacy"] == privacy
    )
    # the global model = base + mean of the clipped updates + N(0, noise x clip / 2)
    base = weights(base_run)
    updates = client_updates(run, base, sft_dirs)
    assert all(
        math.sqrt(sum(float(np.square(v).sum()) for v in u.values())) > 2 * clip
        for u in updates
    )
    mean = {k: sum(clipped(u, clip)[k] for u in updates) / 2 for k in base}
    residual = np.concatenate(
        [(w - base[k] - mean[k]).ravel() for k, w in weights(run / "server").items()]
    )
    assert residual.size > 50_000
    # Flower draws the noise from NumPy's unseeded generator: fresh every run.
    # Its mean is within five standard errors of 0 (a bound of 1e-4, 2.1 of
    # them here, failed about one run in 30: CI saw 1.08e-4)
    sigma = noise * clip / 2
    assert abs(residual.mean()) < 5 * sigma / math.sqrt(residual.size)
    assert abs(residual.std() / sigma - 1) < 0.02


@pytest.mark.slow  # the default suite runs client DP end to end in the test above
def test_no_noise_and_a_large_clip_is_plain_fedavg(base_run, sft_dirs, tmp_path):
    """Server-side clipping that clips nothing and no noise: the plain mean of
    the clients' models (under DP every client counts once); ε is infinite."""
    # Prepare
    settings = one_round(dp="server", dp_noise_multiplier=0.0, dp_clipping_norm=1e6)
    run = tmp_path / "run"
    # Execute
    result = simulate(base_run, sft_dirs, run, settings)
    # Assert
    assert result["history"][0]["accepted"] == 2
    assert result["privacy"]["epsilon"] is None  # no finite bound
    models = [weights(run / "clients" / n) for n in sft_dirs]
    server = weights(run / "server")
    diff = max(
        float(np.abs(server[k] - (models[0][k] + models[1][k]) / 2).max())
        for k in server
    )
    assert diff < 1e-6


@pytest.mark.slow
def test_secure_aggregation_with_client_dp_is_the_uniform_mean(
    base_run, sft_dirs, tmp_path
):
    """SecAgg+ and client-side clipping together (the clients clip, then mask):
    with no noise and a clip that clips nothing, the global model is the plain
    mean of the clients' models up to SecAgg+'s quantisation (every client
    weighs 1 under DP)."""
    from aisyn.fl.secure import QUANTIZATION_RANGE

    settings = one_round(
        secure_aggregation=True,
        dp="client",
        dp_noise_multiplier=0.0,
        dp_clipping_norm=1e6,
    )
    run = tmp_path / "run"
    result = simulate(base_run, sft_dirs, run, settings)
    assert result["history"][0]["secure_aggregation"]["dropped"] == []
    models = [weights(run / "clients" / n) for n in sft_dirs]
    server = weights(run / "server")
    level = 2 * settings.secagg_clipping_range / QUANTIZATION_RANGE
    diff = max(
        float(np.abs(server[k] - (models[0][k] + models[1][k]) / 2).max())
        for k in server
    )
    assert diff <= level + 1e-6

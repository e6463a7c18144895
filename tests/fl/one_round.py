"""Shared by the secure-aggregation and client-DP tests: one short round's
settings, and a run's weights as float64 arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from aisyn.fl.settings import FLSettings
from aisyn.train.checkpoint import model_file, read_tensors


def one_round(**overrides) -> FLSettings:
    """One short round (same seed everywhere: the clients train identically)."""
    return FLSettings.from_dict(
        dict(
            rounds=1,
            local_steps=2,
            batch_size=8,
            lr=3e-3,
            warmup=1,
            eval_items=8,
            min_clients=2,
            round_timeout=120,
        )
        | overrides
    )


def weights(run: Path) -> dict[str, np.ndarray]:
    return {k: v.double().numpy() for k, v in read_tensors(model_file(run)).items()}

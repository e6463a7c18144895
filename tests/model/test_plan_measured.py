"""The planner's memory against measured runs: each process's peak RSS
(VmHWM) of a split run over gRPC (``aisyn split serve`` + ``aisyn split
train``) and of ``aisyn train``, at 350M's width (hidden 1280, 32 heads, FFN
5120) with 8 blocks, is within 15 % of what the planner predicts for it; the
split losses are the unsplit ones. ``bench/scale.py`` runs the same for 350M
itself."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from aisyn.model.families import load_config

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scale.py"


def bench():
    spec = importlib.util.spec_from_file_location("scale_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_peak_rss_of_each_party_is_the_planners(tmp_path):
    # Prepare: 350M's width, 8 ordinary blocks + the top query layer
    model = tmp_path / "model.json"
    model.write_text(json.dumps({**load_config("350M").to_dict(), "num_layers": 9}))
    # Execute: 2 steps of each run at batch 1, seq 512
    r = bench().measure_350m(str(model), 2, 512, tmp_path / "runs", threads=2)
    # Assert
    u, s = r["unsplit"], r["split"]
    pairs = [(u["peak_rss"], u["predicted"])]
    pairs += [(s["peak_rss"][p], s["predicted"][p]) for p in ("A", "B")]
    for measured, predicted in pairs:
        assert abs(predicted / measured - 1) <= 0.15, (measured, predicted)
    assert s["losses"] == pytest.approx(u["losses"], rel=1e-5)

"""The efficiency benchmark runs end to end (tiny model, one step per
configuration). Its numbers are not checked here -- timing never is in tests --
only that every configuration ran, exactly where it must be exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "split_efficiency.py"


@pytest.mark.slow
def test_split_efficiency_quick_runs(tmp_path, split_config):
    model = tmp_path / "model.json"
    model.write_text(json.dumps(split_config.to_dict()))
    out = tmp_path / "bench.json"
    args = [sys.executable, str(BENCH), "--quick", "--model", str(model)]
    args += ["--steps", "1", "--warmup", "0", "--loss-steps", "2"]
    args += ["--json", str(out), "--cut", "u:1,1"]
    res = subprocess.run(
        args, capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| split, gRPC | shaped 20 ms RTT, 1000 Mbit/s | pipelined" in res.stdout
    assert "in-process lockstep: x" in res.stdout
    # the balanced section: a deeper model, the planner's cut, both links
    balanced = [line for line in res.stdout.splitlines() if "planner floor x" in line]
    assert len(balanced) == 2 and all("pipelined x" in line for line in balanced)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 10  # 2 in-process, 3+1 loopback, 4 shaped (quick)
    for row in rows:
        if row["codec"] == "none":
            for a, b in zip(row["losses"], row["base_losses"], strict=True):
                assert a == pytest.approx(b, rel=1e-5)

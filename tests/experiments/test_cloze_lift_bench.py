"""bench/cloze_lift.py runs end to end on the ci preset (two checkpoints, a
capped share of each domain): every checkpoint is scored on every domain and
the lift lines are the base's better format against the best checkpoint. Its
numbers are not judged here -- only that they are what the JSON holds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cloze_lift.py"


def run_bench(out: Path, *flags: str, timeout: float = 900):
    """The bench on the ci preset into ``out``: (its process, lift.json or None)."""
    args = [sys.executable, str(BENCH), "--preset", "ci", *flags, "--out", str(out)]
    res = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    lift = out / "lift.json"
    return res, json.loads(lift.read_text()) if lift.is_file() else None


@pytest.mark.slow
def test_cloze_lift_scores_every_checkpoint_and_prints_the_lift(tmp_path):
    flags = ["--steps", "4", "--every", "2", "--max-train-items", "100"]
    res, report = run_bench(tmp_path / "lift", *flags)
    assert res.returncode == 0, res.stderr[-2000:]
    for name in ("news", "reviews"):
        run = report["runs"][name]
        assert 90 <= run["items"] <= 110  # the capped share, not the domain
        assert [p["step"] for p in run["points"]] == [2, 4]
        floor = max(report["base"][f][name] for f in ("lm", "prompt"))
        best = max(p[name] for p in run["points"])
        line = re.search(
            rf"^lift {name}: base ([\d.]+) % .* -> ([\d.]+) %", res.stdout, re.M
        )
        assert line is not None, res.stdout
        assert float(line.group(1)) == pytest.approx(floor, abs=0.05)
        assert float(line.group(2)) == pytest.approx(best, abs=0.05)


def test_a_tuned_domain_outside_the_scored_ones_is_refused_before_anything_runs(
    tmp_path,
):
    out = tmp_path / "lift"
    res, _ = run_bench(out, "--tune", "poems", timeout=120)
    assert res.returncode != 0
    assert "--tune names no domain of --domains: ['poems']" in res.stderr
    assert not out.exists()


@pytest.mark.slow
def test_tune_fine_tunes_one_domain_and_scores_both(tmp_path):
    flags = ["--steps", "2", "--every", "2", "--tune", "reviews"]
    res, report = run_bench(tmp_path / "lift", *flags)
    assert res.returncode == 0, res.stderr[-2000:]
    assert list(report["runs"]) == ["reviews"]
    assert set(report["runs"]["reviews"]["points"][0]) == {"step", "news", "reviews"}
    assert re.search(r"^lift reviews: ", res.stdout, re.M)
    assert not re.search(r"^lift news: ", res.stdout, re.M)


@pytest.mark.slow
def test_pooled_fine_tunes_one_model_on_every_tuned_domain(tmp_path):
    flags = ["--steps", "2", "--every", "2", "--max-train-items", "100", "--pooled"]
    res, report = run_bench(tmp_path / "lift", *flags)
    assert res.returncode == 0, res.stderr[-2000:]
    # one run over both capped shares, scored on both domains
    assert list(report["runs"]) == ["news+reviews"]
    assert 180 <= report["runs"]["news+reviews"]["items"] <= 220
    point = report["runs"]["news+reviews"]["points"][0]
    for name in ("news", "reviews"):
        line = re.search(
            rf"^lift {name} \(news\+reviews ft\): base [\d.]+ % .* -> ([\d.]+) %",
            res.stdout,
            re.M,
        )
        assert line is not None, res.stdout
        assert float(line.group(1)) == pytest.approx(point[name], abs=0.05)


@pytest.mark.slow
def test_batch_size_trains_with_that_batch_in_a_run_of_its_own(tmp_path):
    # fusion at a federation's parallelism: the batch reaches the fine-tuning
    # run, whose folder is not the preset batch's (a resume never mixes them)
    flags = ["--steps", "2", "--every", "2", "--max-train-items", "100"]
    flags += ["--pooled", "--batch-size", "4"]
    res, report = run_bench(tmp_path / "lift", *flags)
    assert res.returncode == 0, res.stderr[-2000:]
    run = tmp_path / "lift" / "news+reviews-2-cap100-b4-answer"
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["batch_size"] == 4
    assert list(report["runs"]) == ["news+reviews"]


@pytest.mark.heavy
def test_a_batch_size_below_one_or_not_a_number_is_refused_before_anything_runs(
    tmp_path,
):
    out = tmp_path / "lift"
    for bad, what in [("0", "--batch-size must be >= 1, got 0"),
                      ("-4", "--batch-size must be >= 1, got -4"),
                      ("nan", "invalid int value: 'nan'")]:  # fmt: skip
        res, _ = run_bench(out, "--batch-size", bad, timeout=120)
        assert res.returncode != 0
        assert what in res.stderr
        assert not out.exists()

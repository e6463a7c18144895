"""The engine's cadence, tested directly on a counting regime: what is logged,
validated and checkpointed after which step, and that a run stopped at any
step and restored from its checkpoint goes on exactly as one never stopped
(records, metrics rows, state)."""

from __future__ import annotations

import pytest

from aisyn.train.engine import Engine
from aisyn.train.run import RunDir, read_metrics


class Counting:
    """A regime whose loss follows from its state alone: resuming it at the
    wrong place, or not at all, changes every later loss."""

    tokens_per_step = 5

    def __init__(self) -> None:
        self.position = 0
        self.saved: dict[int, dict] = {}  # step -> state, as a checkpoint
        self.validated: list[int] = []

    def train_step(self, step: int) -> dict:
        assert step == self.position, "the engine ran a step out of order"
        self.position += 1
        return {"loss": 1.0 / self.position, "lr": 0.1, "grad_norm": 1.0}

    def record_fields(self) -> dict:
        return {"epoch": self.position // 4}

    def log_line(self, done: int, total: int, record: dict) -> str:
        return f"step {done}/{total}"

    def validate(self) -> float:
        self.validated.append(self.position)
        return 2.0 / self.position

    def save(self, step: int, state: dict) -> None:
        self.saved[step] = {**state, "step": step}

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load(self, folder):
        if folder is None:
            return None
        state = self.saved[folder]
        self.position = state["position"]
        return state


def _engine(run, total=7, **kw) -> Engine:
    cadence = {"log_every": 3, "eval_every": 3, "ckpt_every": 3, **kw}
    return Engine(run, total_steps=total, progress=False, plot=False, **cadence)


def test_the_last_step_always_logs_validates_and_checkpoints(tmp_path):
    run = RunDir(tmp_path)
    regime = Counting()

    summary = _engine(run).run(regime, range(7))

    logged = [r["step"] for r in read_metrics(run.metrics_path)]
    assert logged == [1, 3, 6, 7]  # the first, every 3rd and the last
    assert regime.validated == [3, 6, 7]
    assert sorted(regime.saved) == [3, 6, 7]
    assert [r["step"] for r in summary["records"]] == logged
    assert summary["steps"] == 7 and summary["tokens"] == 35
    assert summary["final_loss"] == pytest.approx(1 / 7)
    assert read_metrics(run.metrics_path)[-1]["val_loss"] == pytest.approx(2 / 7)


def test_a_run_stopped_early_checkpoints_its_stop_step_without_validating(tmp_path):
    regime = Counting()

    _engine(RunDir(tmp_path), total=10).run(regime, range(4))

    assert sorted(regime.saved) == [3, 4]  # the cadence's, then the stop step
    assert regime.validated == [3]  # step 4 is not the run's last


def test_no_cadence_still_logs_and_checkpoints_the_last_step(tmp_path):
    run = RunDir(tmp_path)
    regime = Counting()

    _engine(run, total=5, log_every=100, eval_every=0, ckpt_every=0).run(
        regime, range(5)
    )

    assert [r["step"] for r in read_metrics(run.metrics_path)] == [1, 5]
    assert regime.validated == [] and sorted(regime.saved) == [5]


@pytest.mark.parametrize("stop", range(1, 7))
def test_a_run_resumed_at_any_step_continues_as_if_never_stopped(tmp_path, stop):
    (tmp_path / "whole").mkdir()
    (tmp_path / "cut").mkdir()
    whole_run = RunDir(tmp_path / "whole")
    whole = Counting()
    _engine(whole_run, ckpt_every=1).run(whole, range(7))

    run = RunDir(tmp_path / "cut")
    first = Counting()
    _engine(run, ckpt_every=1).run(first, range(stop))
    # a killed attempt's rows after the checkpoint are dropped on resume
    run.log_metrics({"step": stop + 1, "loss": -1.0})
    second = Counting()
    second.saved = first.saved  # what the checkpoint folder holds
    engine = _engine(run, ckpt_every=1)

    start = engine.restore(second, stop, resume=True)
    engine.run(second, range(start, 7))

    assert start == stop
    strip = [
        {k: v for k, v in r.items() if k != "elapsed_s"}
        for r in read_metrics(run.metrics_path)
    ]
    want = [
        {k: v for k, v in r.items() if k != "elapsed_s"}
        for r in read_metrics(whole_run.metrics_path)
    ]
    assert strip == want
    assert second.saved[7]["position"] == whole.saved[7]["position"] == 7
    assert second.saved[7]["tokens"] == whole.saved[7]["tokens"] == 35


def test_a_fresh_restore_starts_at_step_zero(tmp_path):
    regime = Counting()
    engine = _engine(RunDir(tmp_path))

    assert engine.restore(regime, None, resume=False) == 0
    assert regime.position == 0

"""docs/architecture.md's example of a new regime (a distillation objective on
the local executor) runs as written: it trains, its loss is not the LM loss,
and a run killed after a checkpoint resumes to the uninterrupted one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aisyn.train.config import TrainConfig
from aisyn.train.pretrain import train
from aisyn.train.regime import Regime
from aisyn.train.run import read_metrics

DOC = Path(__file__).parents[2] / "docs" / "architecture.md"


def _example() -> dict:
    text = DOC.read_text(encoding="utf-8")
    block = re.search(
        r"<!-- example: the test runs the python block below -->\n```python\n"
        r"(.*?)```",
        text,
        re.S,
    )
    assert block is not None, "docs/architecture.md lost its example"
    namespace: dict = {}
    exec(compile(block.group(1), str(DOC), "exec"), namespace)
    return namespace


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl")]


@pytest.mark.heavy
def test_the_documented_distillation_regime_trains_and_resumes(
    tmp_path, news_data, tiny_config, monkeypatch
):
    distil = _example()["distil"]
    teacher = tmp_path / "teacher"
    cfg = TrainConfig(
        steps=4, batch_size=4, micro_batch_size=2, log_every=1, ckpt_every=2, seed=3
    )
    train(tiny_config, [news_data], teacher, cfg, progress=False)

    whole = distil(tiny_config, teacher, [news_data], tmp_path / "whole", cfg)
    real_step = Regime.train_step
    calls = {"n": 0}

    def killed_in_step_3(self, step):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("simulated kill")
        return real_step(self, step)

    monkeypatch.setattr(Regime, "train_step", killed_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        distil(tiny_config, teacher, [news_data], tmp_path / "cut", cfg)
    monkeypatch.setattr(Regime, "train_step", real_step)
    distil(tiny_config, teacher, [news_data], tmp_path / "cut", cfg, resume=True)

    assert len(_losses(tmp_path / "whole")) == 4
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")
    # the objective trained is the documented one, not next-token prediction
    assert _losses(tmp_path / "whole")[0] != pytest.approx(_losses(teacher)[0])
    assert whole["final_loss"] == _losses(tmp_path / "whole")[-1]

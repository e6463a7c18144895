import json

import pytest
import torch

from aisyn.model.families import build_model
from aisyn.model.pangu import PanguConfig
from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.models import load_model_checkpoint, load_run_model
from aisyn.train.pretrain import train
from aisyn.train.regime import Regime
from aisyn.train.run import read_metrics


def _losses(run):
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def _cfg(**kw):
    base = dict(steps=12, batch_size=4, lr=3e-3, warmup_steps=3, log_every=1, seed=7)
    return TrainConfig(**{**base, **kw})


def test_seeded_training_is_reproducible_and_learns(tmp_path, news_data, tiny_config):
    a = train(tiny_config, [news_data], tmp_path / "a", _cfg(), progress=False)
    b = train(tiny_config, [news_data], tmp_path / "b", _cfg(), progress=False)

    la, lb = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert la == lb  # bit-identical on CPU
    assert len(la) == 12
    assert la[-1] < la[0] - 0.5
    assert a["tokens"] == 12 * 4 * 32
    rec = read_metrics(tmp_path / "a" / "metrics.jsonl")[0]
    assert {"step", "loss", "lr", "tokens", "elapsed_s"} <= set(rec)
    assert (tmp_path / "a" / "loss.png").stat().st_size > 1000
    assert b["final_loss"] == la[-1]


def test_gradient_accumulation_matches_one_big_batch(tmp_path, news_data, tiny_config):
    train(tiny_config, [news_data], tmp_path / "big", _cfg(steps=5), progress=False)
    train(
        tiny_config,
        [news_data],
        tmp_path / "acc",
        _cfg(steps=5, micro_batch_size=1),
        progress=False,
    )

    big, acc = _losses(tmp_path / "big"), _losses(tmp_path / "acc")
    assert big == pytest.approx(acc, rel=1e-5)


@pytest.mark.heavy
def test_resume_continues_the_same_trajectory(
    tmp_path, news_data, tiny_config, monkeypatch
):
    cfg = _cfg(ckpt_every=5)
    train(tiny_config, [news_data], tmp_path / "full", cfg, progress=False)

    real_step = Regime.train_step
    calls = {"n": 0}

    def crashing_step(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 8:  # dies after the step-5 checkpoint, mid-run
            raise KeyboardInterrupt("simulated kill")
        return real_step(*args, **kw)

    monkeypatch.setattr(Regime, "train_step", crashing_step)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config, [news_data], tmp_path / "cut", cfg, progress=False)
    monkeypatch.setattr(Regime, "train_step", real_step)
    assert ckpt.latest(tmp_path / "cut" / "checkpoints").name == "step_00000005"
    with pytest.raises(FileExistsError, match="pass --resume"):
        train(tiny_config, [news_data], tmp_path / "cut", cfg, progress=False)

    train(tiny_config, [news_data], tmp_path / "cut", cfg, resume=True, progress=False)

    assert _losses(tmp_path / "cut") == _losses(tmp_path / "full")
    steps = [r["step"] for r in read_metrics(tmp_path / "cut" / "metrics.jsonl")]
    assert steps == list(range(1, 13))
    m1, _ = load_run_model(tmp_path / "full")
    m2, _ = load_run_model(tmp_path / "cut")
    for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p1, p2)


def test_checkpoint_of_another_config_is_refused(tmp_path, news_data, tiny_config):
    train(tiny_config, [news_data], tmp_path / "r", _cfg(steps=2), progress=False)
    other = PanguConfig(**{**tiny_config.to_dict(), "hidden_size": 64})

    with pytest.raises(ckpt.CheckpointError, match="has shape .* another config"):
        load_model_checkpoint(build_model(other), tmp_path / "r")
    with pytest.raises(ValueError, match="different model"):
        train(
            other,
            [news_data],
            tmp_path / "r",
            _cfg(steps=2),
            resume=True,
            progress=False,
        )


def test_corrupt_checkpoint_file_is_reported(tmp_path, news_data, tiny_config):
    train(tiny_config, [news_data], tmp_path / "r", _cfg(steps=2), progress=False)
    last = ckpt.latest(tmp_path / "r" / "checkpoints")
    (last / ckpt.MODEL_FILE).write_bytes(b"not safetensors")

    with pytest.raises(ckpt.CheckpointError, match="corrupt safetensors"):
        load_run_model(tmp_path / "r")


def test_public_port_checkpoint_with_separate_lm_head_loads(tiny_config):
    src = build_model(tiny_config, seed=1)
    tensors = {k: v.clone() for k, v in src.state_dict().items()}  # has lm_head
    dst = build_model(tiny_config, seed=2)

    ckpt.load_weights(dst, tensors, "port.safetensors")

    assert torch.equal(dst.transformer.wte.weight, src.transformer.wte.weight)
    assert dst.lm_head.weight is dst.transformer.wte.weight


def test_config_json_records_the_run(tmp_path, news_data, tiny_config):
    train(tiny_config, [news_data], tmp_path / "r", _cfg(steps=1), progress=False)

    cfg = json.loads((tmp_path / "r" / "config.json").read_text())

    assert cfg["model"]["hidden_size"] == 32
    assert cfg["train"]["steps"] == 1
    assert cfg["tokenizer"]["vocab_size"] == 8000
    assert (tmp_path / "r" / "tokenizer.model").is_file()


def _crash_at_call(monkeypatch, n: int):
    """Make the n-th ``train_step`` raise, as a kill would end the run there."""
    real_step = Regime.train_step
    calls = {"n": 0}

    def crashing_step(*args, **kw):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt("simulated kill")
        return real_step(*args, **kw)

    monkeypatch.setattr(Regime, "train_step", crashing_step)
    return real_step


def test_resume_before_any_checkpoint_keeps_only_the_rerun_metrics(
    tmp_path, news_data, tiny_config, monkeypatch
):
    cfg = _cfg(steps=5)
    train(tiny_config, [news_data], tmp_path / "full", cfg, progress=False)
    real_step = _crash_at_call(monkeypatch, 3)  # killed after logging 2 steps
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config, [news_data], tmp_path / "cut", cfg, progress=False)
    monkeypatch.setattr(Regime, "train_step", real_step)
    assert ckpt.latest(tmp_path / "cut" / "checkpoints") is None

    train(tiny_config, [news_data], tmp_path / "cut", cfg, resume=True, progress=False)

    steps = [r["step"] for r in read_metrics(tmp_path / "cut" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5]  # not [1, 2, 1, 2, 3, 4, 5]
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "full")


def test_resume_with_steps_at_or_below_the_runs_step(tmp_path, news_data, tiny_config):
    run = tmp_path / "r"
    train(tiny_config, [news_data], run, _cfg(steps=4), progress=False)
    config = (run / "config.json").read_text()
    metrics = (run / "metrics.jsonl").read_text()

    with pytest.raises(ValueError, match="--steps 2 is below the 4 steps"):
        train(tiny_config, [news_data], run, _cfg(steps=2), resume=True, progress=False)
    done = train(
        tiny_config, [news_data], run, _cfg(steps=4), resume=True, progress=False
    )

    assert done["final_loss"] == _losses(run)[-1]  # the run's, not nan
    assert done["steps"] == 4
    assert (run / "config.json").read_text() == config  # nothing rewritten
    assert (run / "metrics.jsonl").read_text() == metrics

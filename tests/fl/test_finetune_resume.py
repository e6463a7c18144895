"""``aisyn finetune --resume``: a fine-tuning run killed after a checkpoint
continues exactly -- the same losses, step for step, and the same final weights
as the run that was never interrupted -- for full fine-tuning and for LoRA
(whose checkpoints carry the adapters and the optimizer beside the merged
weights ``aisyn eval`` reads)."""

from __future__ import annotations

import pytest
import torch

from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.finetune import finetune
from aisyn.train.lora import Method
from aisyn.train.regime import Regime
from aisyn.train.run import read_metrics


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(
        **{
            "steps": 6,
            "batch_size": 4,
            "micro_batch_size": 2,
            "lr": 3e-3,
            "warmup_steps": 1,
            "log_every": 1,
            "ckpt_every": 3,
            "seed": 11,
            **kw,
        }
    )


def _losses(run) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


@pytest.mark.heavy
@pytest.mark.parametrize("method", [Method(), Method("lora", rank=4)])
def test_a_killed_finetune_resumes_to_the_uninterrupted_run(
    tmp_path, base_run, sft_dirs, method, monkeypatch
):
    # Prepare: the uninterrupted run, and one killed in step 5 (after step 3's
    # checkpoint)
    data = [sft_dirs["news"]]
    full = finetune(base_run, data, tmp_path / "full", _cfg(), method, progress=False)
    real_step = Regime.train_step
    calls = {"n": 0}

    def killed_in_step_5(self, step):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt("simulated kill")
        return real_step(self, step)

    monkeypatch.setattr(Regime, "train_step", killed_in_step_5)
    with pytest.raises(KeyboardInterrupt):
        finetune(base_run, data, tmp_path / "cut", _cfg(), method, progress=False)
    monkeypatch.setattr(Regime, "train_step", real_step)
    assert ckpt.latest(tmp_path / "cut" / "checkpoints").name == "step_00000003"
    with pytest.raises(FileExistsError, match="pass --resume"):
        finetune(base_run, data, tmp_path / "cut", _cfg(), method, progress=False)

    # Execute
    resumed = finetune(
        base_run, data, tmp_path / "cut", _cfg(), method, resume=True, progress=False
    )

    # Assert: the same trajectory and weights, bit for bit
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "full")
    steps = [r["step"] for r in read_metrics(tmp_path / "cut" / "metrics.jsonl")]
    assert steps == list(range(1, 7))
    assert resumed["final_loss"] == full["final_loss"]
    a = ckpt.read_tensors(ckpt.model_file(tmp_path / "full"))
    b = ckpt.read_tensors(ckpt.model_file(tmp_path / "cut"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_finished_finetune_resumed_trains_nothing_and_reports_its_summary(
    tmp_path, base_run, sft_dirs
):
    data = [sft_dirs["news"]]
    out = tmp_path / "run"
    first = finetune(base_run, data, out, _cfg(steps=2), progress=False)
    again = finetune(base_run, data, out, _cfg(steps=2), resume=True, progress=False)
    assert again == first
    with pytest.raises(ValueError, match="--steps 1 is below the 2 steps"):
        finetune(base_run, data, out, _cfg(steps=1), resume=True, progress=False)


def test_a_resume_that_does_not_fit_the_run_is_one_line_and_loses_nothing(
    tmp_path, base_run, sft_dirs, base_run_factory, fl_config, tokenizer
):
    # Prepare: a LoRA run with its checkpoint, and what it looks like on disk
    data = [sft_dirs["news"]]
    out = tmp_path / "run"
    lora = Method("lora", rank=4)
    finetune(base_run, data, out, _cfg(steps=3), lora, progress=False)
    config_before = (out / "config.json").read_bytes()
    last = ckpt.latest(out / "checkpoints")
    other_base = base_run_factory(tmp_path / "other", fl_config, tokenizer, seed=9)

    # Execute / Assert: another method, another base, a tampered adapters file
    with pytest.raises(ValueError, match="fine-tuned with --method lora"):
        finetune(base_run, data, out, _cfg(), Method(), resume=True, progress=False)
    with pytest.raises(ValueError, match="resume it from the same base"):
        finetune(other_base, data, out, _cfg(), lora, resume=True, progress=False)
    assert (out / "config.json").read_bytes() == config_before
    adapters = ckpt.read_tensors(last / "adapters.safetensors")
    name = next(iter(adapters))
    bad = {**adapters, name: torch.zeros(3, 3)}
    from safetensors.torch import save_file

    save_file(bad, str(last / "adapters.safetensors"))
    with pytest.raises(ckpt.CheckpointError, match=f"{name} has shape"):
        finetune(base_run, data, out, _cfg(), lora, resume=True, progress=False)
    assert ckpt.latest(out / "checkpoints") == last  # nothing newer was written

"""``aisyn train --data-parallel fsdp``: FSDP2 ranks train as one process
does, write the checkpoints one process writes, and resume exactly."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from group_run import run_group

from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.models import load_run_model
from aisyn.train.pretrain import train
from aisyn.train.run import read_metrics

ARGS = ["--batch-size", "4", "--lr", "3e-3", "--warmup", "2", "--log-every", "1",
        "--seed", "3", "--eval-every", "3"]  # fmt: skip


def torchrun(model_file, data, out: Path, *args: str, ranks: int = 2) -> None:
    proc = run_group(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ranks), "-m", "aisyn.cli", "train", "--quiet",
            "--model", str(model_file), "--data", str(data), "--out", str(out),
            *ARGS, *args,
        ],
        timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def records(run: Path, key: str) -> list[float]:
    return [r[key] for r in read_metrics(run / "metrics.jsonl") if key in r]


def final_model(run: Path) -> dict[str, torch.Tensor]:
    return ckpt.read_tensors(ckpt.latest(run / "checkpoints") / ckpt.MODEL_FILE)


def rewind(run: Path, step: int, last: int) -> None:
    """As if the run had been killed after checkpoint ``step``."""
    shutil.rmtree(ckpt.step_folder(run / "checkpoints", last))
    (run / "checkpoints" / "latest").write_text(f"step_{step:08d}")


@pytest.mark.heavy
@pytest.mark.parametrize(
    "micro",
    [1, pytest.param(None, marks=pytest.mark.slow)],
    ids=["accumulating", "default-flags"],
)
def test_fsdp_ranks_train_as_one_process(tmp_path, news_data, model_file, micro):
    """Two FSDP2 ranks (with gradient accumulation: their reduce-scatter on
    the last micro-batch only) take one process's steps: losses, validation
    losses and final weights within 1e-5, in a checkpoint of whole tensors
    that ``aisyn eval``'s loader reads."""
    extra = ["--micro-batch-size", str(micro)] if micro else []
    torchrun(model_file, news_data, tmp_path / "fsdp", "--steps", "6",
             "--data-parallel", "fsdp", *extra)  # fmt: skip
    cfg = TrainConfig(steps=6, batch_size=4, micro_batch_size=micro, lr=3e-3,
                      warmup_steps=2, log_every=1, seed=3, eval_every=3)  # fmt: skip
    train(str(model_file), [news_data], tmp_path / "one", cfg, progress=False)
    # (the gradient norm is summed from the shards' norms: float32 apart)
    for key, rel in (("loss", 1e-5), ("val_loss", 1e-5), ("grad_norm", 1e-4)):
        got, want = records(tmp_path / "fsdp", key), records(tmp_path / "one", key)
        assert len(got) == len(want) > 0
        assert got == pytest.approx(want, rel=rel), key
    sharded, whole = final_model(tmp_path / "fsdp"), final_model(tmp_path / "one")
    assert sharded.keys() == whole.keys()
    for name, t in whole.items():
        torch.testing.assert_close(sharded[name], t, rtol=1e-4, atol=1e-5)
    assert (
        json.loads((tmp_path / "fsdp" / "config.json").read_text())["data_parallel"]
        == "fsdp"
    )
    model, _ = load_run_model(tmp_path / "fsdp")
    assert sum(p.numel() for p in model.parameters()) == sum(
        t.numel() for t in whole.values()
    )


@pytest.mark.heavy
def test_fsdp_resumes_exactly_and_ddp_resumes_its_checkpoints(
    tmp_path, news_data, model_file
):
    """A run killed after step 3 and resumed under FSDP2 reaches the whole
    run's weights bit for bit; the same checkpoint resumed under DDP (its
    AdamW moments whole) reaches them within 1e-5."""
    steps = ["--steps", "6", "--ckpt-every", "3"]
    whole = tmp_path / "whole"
    torchrun(model_file, news_data, whole, *steps, "--data-parallel", "fsdp")
    for name, parallel in (("again", "fsdp"), ("ddp", "ddp")):
        run = tmp_path / name
        shutil.copytree(whole, run)
        rewind(run, 3, 6)
        torchrun(model_file, news_data, run, *steps, "--resume",
                 "--data-parallel", parallel)  # fmt: skip
        got, want = final_model(run), final_model(whole)
        assert records(run, "loss") == pytest.approx(records(whole, "loss"), rel=1e-5)
        for n, t in want.items():
            if parallel == "fsdp":
                assert torch.equal(got[n], t), n
            else:
                torch.testing.assert_close(got[n], t, rtol=1e-4, atol=1e-5)

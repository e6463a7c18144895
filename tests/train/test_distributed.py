"""Data-parallel training with torchrun equals single-process training."""

import os
import sys

import pytest
from group_run import run_group

from aisyn.train.config import TrainConfig, per_rank_micro_batches
from aisyn.train.pretrain import train
from aisyn.train.run import read_metrics


@pytest.mark.heavy
@pytest.mark.parametrize("micro", [1, None], ids=["accumulating", "default-flags"])
def test_two_ranks_match_one_process(tmp_path, news_data, model_file, micro):
    """With --micro-batch-size 1 (accumulation under DDP) and with the default
    flags, which once failed at 2 ranks ("batch_size 8 must split into 2 ranks
    x micro-batches of 8")."""
    model = model_file
    args = [
        *(["--micro-batch-size", str(micro)] if micro else []),
        "--steps",
        "6",
        "--batch-size",
        "4",
        "--lr",
        "3e-3",
        "--warmup",
        "2",
        "--log-every",
        "1",
        "--seed",
        "3",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    proc = run_group(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "aisyn.cli",
            "train",
            "--model",
            str(model),
            "--data",
            str(news_data),
            "--out",
            str(tmp_path / "ddp"),
            "--quiet",
            *args,
        ],
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = TrainConfig(
        steps=6,
        batch_size=4,
        micro_batch_size=micro,
        lr=3e-3,
        warmup_steps=2,
        log_every=1,
        seed=3,
    )
    train(str(model), [news_data], tmp_path / "single", cfg, progress=False)

    ddp = [r["loss"] for r in read_metrics(tmp_path / "ddp" / "metrics.jsonl")]
    single = [r["loss"] for r in read_metrics(tmp_path / "single" / "metrics.jsonl")]
    assert len(ddp) == 6
    assert ddp == pytest.approx(single, rel=1e-5)
    assert (tmp_path / "ddp" / "checkpoints" / "latest").is_file()


def test_batch_must_split_over_ranks(monkeypatch, tmp_path, news_data):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")

    with pytest.raises(ValueError, match="--batch-size 4 does not split into 3 ranks"):
        train(
            "tiny",
            [news_data],
            tmp_path / "r",
            TrainConfig(steps=1, batch_size=4),
            progress=False,
        )


def test_default_micro_batch_is_each_ranks_share():
    cfg = TrainConfig(steps=1, batch_size=8)

    assert per_rank_micro_batches(cfg, 2).micro == 4  # one micro-batch per rank
    assert per_rank_micro_batches(cfg, 1) is cfg
    # 4 divides the batch of 12 but not a rank's share of 6
    uneven = TrainConfig(steps=1, batch_size=12, micro_batch_size=4)
    with pytest.raises(ValueError, match="give a --micro-batch-size that divides 6"):
        per_rank_micro_batches(uneven, 2)

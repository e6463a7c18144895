"""``--tensorboard``: every regime's metrics records also land in TensorBoard
event files, through the one place they are written (``RunDir.log_metrics``)."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from aisyn.cli import build_parser
from aisyn.fl.cli import settings_from_args
from aisyn.train.config import TrainConfig
from aisyn.train.pretrain import train
from aisyn.train.run import RunDir, read_metrics


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


def test_standalone_training_writes_the_metrics_to_tensorboard(
    tmp_path, news_data, tiny_config
):
    out = tmp_path / "run"
    cfg = TrainConfig(steps=4, batch_size=4, log_every=2, eval_every=4, seed=3)
    train(tiny_config, [news_data], out, cfg, progress=False, tensorboard=True)
    scalars = _scalars(out)
    logged = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [s for s, _ in scalars["loss"]] == [r["step"] for r in logged] == [1, 2, 4]
    for (_, value), r in zip(scalars["loss"], logged, strict=True):
        assert abs(value - r["loss"]) < 1e-6
    assert [s for s, _ in scalars["val_loss"]] == [4]
    assert {"lr", "grad_norm", "tokens"} <= set(scalars)


def test_without_the_flag_no_event_files(tmp_path, news_data, tiny_config):
    out = tmp_path / "run"
    train(
        tiny_config,
        [news_data],
        out,
        TrainConfig(steps=2, batch_size=4),
        progress=False,
    )
    assert not (out / "tensorboard").exists()


def test_a_federated_server_logs_by_round(tmp_path):
    run = RunDir(tmp_path / "server")
    run.path.mkdir()
    run.enable_tensorboard()
    run.log_metrics({"round": 1, "global_valid_loss": 5.0, "clients": ["a"]})
    run.log_metrics({"round": 2, "global_valid_loss": 4.5})
    run.close()
    assert _scalars(run.path)["global_valid_loss"] == [(1, 5.0), (2, 4.5)]


def test_every_training_command_takes_the_flag():
    parser = build_parser()
    for argv in (
        ["train", "--data", "d", "--out", "o", "--tensorboard"],
        ["split", "train", "--data", "d", "--out", "o", "--tensorboard"],
        ["finetune", "--base", "b", "--data", "d", "--out", "o", "--tensorboard"],
        ["experiment", "compare", "--out", "o", "--tensorboard"],
    ):
        assert parser.parse_args(argv).tensorboard is True, argv
    args = parser.parse_args(
        [
            "fl",
            "simulate",
            "--base",
            "b",
            "--client",
            "a=x",
            "--out",
            "o",
            "--tensorboard",
        ]
    )
    assert settings_from_args(args).tensorboard is True
    args = parser.parse_args(
        ["fl", "simulate", "--base", "b", "--client", "a=x", "--out", "o"]
    )
    assert settings_from_args(args).tensorboard is False

"""Evaluation through the link equals evaluation of the merged model, and the
merged run is an ordinary run folder."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CUT, train_cfg

from aisyn.cli import main
from aisyn.data.cloze import ClozeItem, write_items
from aisyn.eval.report import evaluate_run
from aisyn.split.client.evaluate import evaluate_split_run, open_split_model
from aisyn.split.client.merge import MergeError, merge
from aisyn.split.client.train import split_train
from aisyn.split.session import SplitOptions
from aisyn.train.models import load_run_model

CLOZE = [
    ClozeItem("今天的", "很好，我们出去走走。", ("天气", "电脑", "股票"), "天气"),
    ClozeItem("公司发布了新的", "，销量很好。", ("手机", "河流", "早饭"), "手机"),
    ClozeItem("他在", "里读书。", ("图书馆", "海洋", "价格"), "图书馆"),
]


@pytest.fixture(scope="module")
def split_run(tmp_path_factory, news_data, split_config):
    out = tmp_path_factory.mktemp("split") / "run"
    split_train(
        split_config,
        [news_data],
        out,
        train_cfg(steps=6, ckpt_every=3),
        SplitOptions(cut=CUT, mode="local"),
        progress=False,
    )
    return out


@pytest.mark.heavy
def test_eval_through_the_link_equals_eval_of_the_merged_run(
    tmp_path, split_run, news_data
):
    # Prepare
    cloze = tmp_path / "cloze.jsonl"
    write_items(CLOZE, cloze)
    merged = tmp_path / "merged"
    # Execute: `aisyn eval` on a split run evaluates through the link
    argv = ["eval", "--run", str(split_run), "--data", str(news_data)]
    assert main([*argv, "--cloze-file", str(cloze), "--device", "cpu"]) == 0
    through_link = json.loads((split_run / "eval.json").read_text())
    folder = merge(split_run, split_run / "compute", merged)
    plain = evaluate_run(merged, data_dir=news_data, cloze_file=cloze, device="cpu")
    # Assert
    assert folder.name == "step_00000006"
    assert through_link["test"]["loss"] == pytest.approx(plain["test"]["loss"], 1e-6)
    assert through_link["cloze"]["accuracy"] == plain["cloze"]["accuracy"]
    assert through_link["cloze"]["items"] == 3


@pytest.mark.heavy
def test_eval_of_a_split_run_needs_the_link(split_run, news_data):
    # evaluate_run alone cannot: the run holds only the data party's half
    with pytest.raises(ValueError, match="evaluate_split_run"):
        evaluate_run(split_run, data_dir=news_data, device="cpu")
    result = evaluate_split_run(split_run, data_dir=news_data, device="cpu")
    assert result["test"]["samples"] > 0


def test_merged_model_is_the_split_model(tmp_path, split_run):
    merge(split_run, split_run / "compute", tmp_path / "merged")
    model, config = load_run_model(tmp_path / "merged")
    assert config["kind"] == "train" and config["merged_from"]["step"] == 6
    tokens = torch.randint(0, 8000, (2, 20))
    with open_split_model(split_run, "cpu") as split_model:
        want = split_model(tokens)
    assert torch.allclose(model(tokens), want, rtol=0, atol=1e-6)


def test_merge_refuses_mismatched_halves(tmp_path, split_run, news_data, split_config):
    other = tmp_path / "other"
    split_train(
        split_config,
        [news_data],
        other,
        train_cfg(steps=2),
        SplitOptions(cut=CUT, mode="local"),
        progress=False,
    )
    compute_of_other = next((other / "compute").iterdir())
    with pytest.raises(MergeError, match="compute half of run"):
        merge(split_run, compute_of_other, tmp_path / "m1")
    with pytest.raises(MergeError, match="not checkpointed by both"):
        merge(split_run, split_run / "compute", tmp_path / "m2", step=5)
    merge(split_run, split_run / "compute", tmp_path / "m3")
    with pytest.raises(FileExistsError):  # never overwrites a run
        merge(split_run, split_run / "compute", tmp_path / "m3")


def test_cli_errors_are_one_line(tmp_path, news_data, token_file, capsys):
    out = tmp_path / "x"
    for argv, message in [
        (
            ["split", "train", "--data", str(news_data), "--out", str(out)]
            + ["--cut", "two-way:1", "--steps", "1"],
            "needs a U-shape cut",
        ),
        (
            ["split", "train", "--data", str(news_data), "--out", str(out)]
            + ["--mode", "grpc", "--peer", "10.0.0.1:5000", "--insecure"]
            + ["--token-file", str(tmp_path / "missing")],
            "no such file",
        ),
        (
            ["split", "train", "--data", str(news_data), "--out", str(out)]
            + ["--mode", "grpc", "--peer", "10.0.0.1:5000", "--insecure"]
            + ["--token-file", str(token_file)],
            "refusing plaintext to non-loopback",
        ),
        (
            ["split", "train", "--data", str(news_data), "--out", str(out)]
            + ["--mode", "grpc", "--peer", "127.0.0.1:5000", "--insecure"]
            + ["--token-file", str(token_file), "--data-peer", "10.0.0.2:5001"],
            "refusing plaintext to non-loopback 10.0.0.2:5001",
        ),
        (["split", "plan", "--model", "2.6B", "--party", "A:1:1GB"], "exactly one"),
        (["split", "plan", "--model", "2.6B", "--party", "A:x"], "NAME:THROUGHPUT"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("aisyn: error:") and message in err[-1], err
    # A malformed address is the flag parser's one line.
    with pytest.raises(SystemExit) as info:
        main(
            ["split", "train", "--data", str(news_data), "--out", str(out)]
            + ["--mode", "grpc", "--peer", "127.0.0.1:5000", "--insecure"]
            + ["--token-file", str(token_file), "--data-peer", "no-port"]
        )
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--data-peer" in err[-1] and "expected HOST:PORT" in err[-1], err
    assert not out.exists()  # nothing written for a run that could not start


def test_cli_plan_prints_each_party(capsys):
    argv = ["split", "plan", "--model", "350M", "--party", "A:1:16GB"]
    assert main([*argv, "--party", "B:4:80GB"]) == 0
    out = capsys.readouterr().out
    assert "cut: --cut u:" in out
    assert "bytes crossing per optimizer step: A->B" in out
    rows = [line for line in out.splitlines() if line.startswith(("A ", "B "))]
    assert len(rows) == 2

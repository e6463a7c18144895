"""Chunked rounds and multi-rank clients through Flower's deployment runtime."""

from __future__ import annotations

import pytest
import torch
from one_round import one_round, weights

from aisyn.fl.launch import simulate
from aisyn.train.run import read_metrics

LIMIT_MB = 0.45  # the tiny model's 1.1 MB of weights in 4 chunks (its 1 MB wte in 3)


@pytest.mark.slow
def test_a_chunked_run_gives_the_unchunked_global_model(base_run, sft_dirs, tmp_path):
    runs = {}
    for mb in (0, LIMIT_MB):
        run = tmp_path / f"mb{mb}"
        result = simulate(base_run, sft_dirs, run, one_round(max_message_mb=mb))
        assert [h["accepted"] for h in result["history"]] == [2]
        runs[mb] = (result, weights(run / "server"))
    chunked, plain = runs[LIMIT_MB], runs[0]
    assert chunked[0]["chunks"] >= 3 and plain[0]["chunks"] == 1
    assert chunked[0]["history"][0]["chunks"] == chunked[0]["chunks"]
    # two clients: a*w1 + b*w2 sums the same in either order, so bit for bit
    for k, v in plain[1].items():
        assert torch.equal(torch.from_numpy(v), torch.from_numpy(chunked[1][k])), k
    assert chunked[0]["final_global_valid_loss"] == plain[0]["final_global_valid_loss"]
    rounds = [
        r
        for r in read_metrics(
            tmp_path / f"mb{LIMIT_MB}" / "clients" / "news" / "metrics.jsonl"
        )
        if "round_loss" in r
    ]
    assert rounds[0]["bytes_sent"] == rounds[0]["bytes_received"] > 0


def test_chunked_settings_a_strategy_cannot_use_are_refused_before_starting(
    base_run, sft_dirs, tmp_path
):
    settings = one_round(max_message_mb=LIMIT_MB, strategy="fedadam")
    with pytest.raises(
        ValueError,
        match=r"^the trainable tensors need \d+ messages .*"
        r"fedadam's server optimiser state is one whole model",
    ):
        simulate(base_run, sft_dirs, tmp_path / "run", settings)
    assert not (tmp_path / "run").exists()


def test_client_ranks_that_do_not_split_the_batch_are_refused(
    base_run, sft_dirs, tmp_path
):
    with pytest.raises(ValueError, match="does not split into --client-ranks 3"):
        simulate(base_run, sft_dirs, tmp_path / "run", one_round(), client_ranks=3)
    assert not (tmp_path / "run").exists()

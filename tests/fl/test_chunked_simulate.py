"""Chunked rounds and multi-rank clients through Flower's deployment runtime."""

from __future__ import annotations

import pytest
import torch
from one_round import one_round, weights

from aisyn.fl.launch import simulate
from aisyn.train.run import read_metrics

LIMIT_MB = 0.45  # the tiny model's 1.1 MB of weights in 4 chunks (its 1 MB wte in 3)


@pytest.mark.slow
def test_chunked_and_two_rank_runs_give_the_plain_global_model(
    base_run, sft_dirs, tmp_path
):
    """Through Flower's runtime: chunks change nothing (bit for bit), and two
    clients of 2 ranks each give the 1-rank global model to 1e-6."""
    runs = {}
    for mb, ranks in ((0, 1), (LIMIT_MB, 1), (LIMIT_MB, 2)):
        run = tmp_path / f"mb{mb}-r{ranks}"
        settings = one_round(max_message_mb=mb, lr=1e-4, batch_size=4)
        result = simulate(base_run, sft_dirs, run, settings, client_ranks=ranks)
        assert [h["accepted"] for h in result["history"]] == [2], result["history"]
        runs[mb, ranks] = (result, weights(run / "server"))
    plain, chunked, ranked = runs[0, 1], runs[LIMIT_MB, 1], runs[LIMIT_MB, 2]
    assert chunked[0]["chunks"] >= 3 and plain[0]["chunks"] == 1
    assert chunked[0]["history"][0]["chunks"] == chunked[0]["chunks"]
    # two clients: a*w1 + b*w2 sums the same in either order, so bit for bit
    for k, v in plain[1].items():
        assert torch.equal(torch.from_numpy(v), torch.from_numpy(chunked[1][k])), k
    assert chunked[0]["final_global_valid_loss"] == plain[0]["final_global_valid_loss"]
    base = weights(base_run)
    moved = max(float(abs(v - base[k]).max()) for k, v in plain[1].items())
    diff = max(float(abs(v - ranked[1][k]).max()) for k, v in plain[1].items())
    assert moved > 1e-5 and diff <= 1e-6, (diff, moved)
    news = tmp_path / f"mb{LIMIT_MB}-r2" / "clients" / "news"
    rounds = [r for r in read_metrics(news / "metrics.jsonl") if "round_loss" in r]
    assert rounds[0]["ranks"] == 2
    assert rounds[0]["bytes_sent"] == rounds[0]["bytes_received"] > 0
    assert (news / "ranks.log").is_file() and not list(news.glob("ranks-*"))


@pytest.mark.heavy
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


def test_the_flags_reach_simulate(monkeypatch):
    import argparse

    import aisyn.fl.launch
    from aisyn.fl import cli

    seen = {}

    def fake_simulate(
        base, clients, out, settings, echo=False, client_ranks=1, resume=False
    ):
        seen.update(settings=settings, ranks=client_ranks, resume=resume)
        return {"history": [], "run": str(out), "clients": {}}

    monkeypatch.setattr(aisyn.fl.launch, "simulate", fake_simulate)
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(
        ["fl", "simulate", "--base", "b", "--out", "o", "--client=a=x"]
        + ["--client-ranks", "2", "--max-message-mb", "0.0625", "--resume"]
    )
    args.func(args)
    assert seen["ranks"] == 2 and seen["settings"].max_message_mb == 0.0625
    assert seen["resume"] is True
    client = parser.parse_args(
        ["fl", "client", "--superlink", "127.0.0.1:1", "--name", "a"]
        + ["--data", "d", "--base", "b", "--out", "o", "--client-ranks", "4"]
    )
    assert client.client_ranks == 4
    with pytest.raises(SystemExit):
        parser.parse_args(
            ["fl", "simulate", "--base", "b", "--out", "o", "--client=a=x"]
            + ["--client-ranks", "0"]
        )

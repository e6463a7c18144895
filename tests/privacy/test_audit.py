"""The privacy audit plays the compute party against a small real run."""

from __future__ import annotations

import csv
import json

import matplotlib.pyplot as plt
import pytest
from test_privacy_plots import check_recovery_figure

from aisyn.cli import main
from aisyn.privacy.audit import AuditSettings, audit, recovery_figure


@pytest.mark.heavy
def test_an_embedding_only_cut_gives_the_text_away(
    tmp_path, base, news_data, reviews_data, tiny_inverter
):
    """With no block before the cut, B knowing the base recovers A's tokens
    from the activations; knowing nothing, it does no better than guessing;
    the labels come back from the gradients."""
    report = audit(
        base,
        news_data,
        reviews_data,
        tmp_path / "out",
        ["u:0,0"],
        settings=AuditSettings(
            samples=2, public_samples=32, steps=60, inverter=tiny_inverter
        ),
    )
    rows = {(r["B_knows"], r["attack"], r["direction"]): r for r in report["rows"]}
    # white-box x B's knowledge x direction, 4 learned forward, 2 backward,
    # the known-plaintext bound, and the base head on B's output
    assert len(report["rows"]) == 12
    known = rows[("base", "white-box", "forward")]
    assert known["recovery"] >= 0.9
    stranger = rows[("nothing", "white-box", "forward")]
    assert stranger["recovery"] <= stranger["frequent_token"] + 0.1
    labels = rows[("base", "white-box", "backward")]
    assert labels["recovery"] > labels["frequent_token"] + 0.2
    head = rows[("base", "base head", "backward")]  # no gradient needed
    assert 0 <= head["recovery"] <= labels["recovery"]
    # the learned decoders, fitted on public text, read the activations too
    # (the MLP in context needs more than these 32 public rows to shine)
    linear = rows[("base", "learned", "forward")]
    assert linear["recovery"] > linear["frequent_token"] + 0.2
    in_context = rows[("base", "learned in context", "forward")]
    assert in_context["recovery"] > in_context["frequent_token"]
    for f in ("audit.md", "audit.csv", "audit.json", "recovery.png"):
        assert (tmp_path / "out" / f).is_file()
    # the plot shows these numbers, each series under its own label
    fig = recovery_figure(report["rows"])
    try:
        check_recovery_figure(fig, report["rows"])
    finally:
        plt.close(fig)
    table = list(csv.DictReader((tmp_path / "out" / "audit.csv").open()))
    assert len(table) == 12 and table[0]["cut"] == "u:0,0"
    assert json.loads((tmp_path / "out" / "audit.json").read_text())["rows"]


def test_a_cut_the_model_cannot_have_is_one_line(
    tmp_path, base, news_data, reviews_data, capsys
):
    argv = [
        "privacy",
        "audit",
        "--base",
        str(base),
        "--data",
        str(news_data),
        "--public",
        str(reviews_data),
        "--out",
        str(tmp_path / "out"),
        "--cut",
        "u:2,2",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "party B would hold no block" in err
    assert not (tmp_path / "out").exists()


def test_under_a_forward_defence_b_sees_its_blocks_on_what_crossed(tiny_config):
    """The attacks read what a split run would give B: its blocks' output on
    the defended activations, and the gradient of A's loss with A's own
    residual stream put back (DataSession._restore), not the clean run's."""
    import torch
    import torch.nn.functional as F

    from aisyn.model.families import build_model
    from aisyn.model.segments import parse_partition
    from aisyn.split.defence.calibration import (
        back_logits,
        blocks_of,
        cut_traffic,
        front,
    )

    model = build_model(tiny_config, seed=3).eval()
    partition = parse_partition("u:1,0", tiny_config)
    rows = torch.randint(0, tiny_config.vocab_size, (2, 9))
    noise = torch.randn(2, 8, tiny_config.hidden_size)
    sent, out, grad = cut_traffic(model, rows, partition, send=lambda h: h + noise)
    # by hand: the clean front, B's blocks on what was sent, the restored loss
    first, middle, back = blocks_of(partition)
    with torch.no_grad():
        clean = front(model, model.embed(rows[:, :-1]), first)
    torch.testing.assert_close(sent, clean + noise)
    y = front(model, sent, middle).detach().requires_grad_(True)
    torch.testing.assert_close(out, y.detach())
    logits = back_logits(model, y + noise.neg(), back)
    loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
    (want,) = torch.autograd.grad(loss, y)
    torch.testing.assert_close(grad, want)
    # no defence: the same traffic as the clean run's
    plain = cut_traffic(model, rows, partition)
    same = cut_traffic(model, rows, partition, send=lambda h: h)
    for a, b in zip(plain, same, strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.allclose(plain[1], out)

"""The privacy audit plays the compute party against a small real run."""

from __future__ import annotations

import csv
import json

import matplotlib.pyplot as plt
from test_privacy_plots import check_recovery_figure

from aisyn.cli import main
from aisyn.privacy.audit import AuditSettings, audit, recovery_figure


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

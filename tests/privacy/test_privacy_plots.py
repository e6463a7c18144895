"""The privacy plots say what the tables say: every plotted series carries the
label of the numbers it plots, each panel has its legend, and a series keeps
its colour across panels. Read from the figures themselves, on the measured
reports kept in docs/privacy_results/ (and, in test_audit.py, on a fresh
audit)."""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from aisyn.privacy.audit import recovery_figure, series_name
from aisyn.privacy.yardstick import figure

RESULTS = Path(__file__).parents[2] / "docs" / "privacy_results"
TEXT = {"cut", "A_weights", "B_knows", "attack", "direction", "defence", "family"}
TEXT |= {"best_attack"}


def _read(name: str) -> list[dict]:
    """A report's rows as the code wrote them (numbers as numbers)."""

    def value(key: str, text: str):
        if key in TEXT:
            return text
        if text == "":
            return None
        number = float(text)
        return int(number) if key.endswith("_on_A") else number

    with (RESULTS / name).open(encoding="utf-8") as f:
        return [{k: value(k, v) for k, v in r.items()} for r in csv.DictReader(f)]


def _legend(ax) -> list[str]:
    legend = ax.get_legend()
    assert legend is not None, f"panel {ax.get_title()!r} has no legend"
    return [t.get_text() for t in legend.get_texts()]


def check_recovery_figure(fig, rows: list[dict]) -> None:
    panels = {ax.get_title().split(":")[0]: ax for ax in fig.axes}
    assert set(panels) == {"forward", "backward"}
    colours: dict[tuple[str, str], tuple] = {}
    for direction, ax in panels.items():
        key = "front_blocks_on_A" if direction == "forward" else "back_blocks_on_A"
        mine = [r for r in rows if r["direction"] == direction]
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        want = {series_name(r) for r in mine}
        assert set(lines) == want | {"frequent token"}
        assert sorted(_legend(ax)) == sorted(lines)
        for name in want:
            rs = sorted(
                (r for r in mine if series_name(r) == name), key=lambda r: r[key]
            )
            line = lines[name]
            assert list(line.get_xdata()) == [r[key] for r in rs], name
            assert list(line.get_ydata()) == pytest.approx(
                [100 * r["recovery"] for r in rs]
            ), name
            kind = (rs[0]["attack"], rs[0]["B_knows"])
            colour = tuple(line.get_color())
            # one colour per attack and B's knowledge, in both panels
            assert colours.setdefault(kind, colour) == colour, name
        freq = lines["frequent token"].get_ydata()
        assert list(freq) == pytest.approx(
            [100 * max(r["frequent_token"] for r in mine)] * 2
        )
    assert len(set(colours.values())) == len(colours)


def test_the_yardstick_plot_says_what_its_table_says():
    """Each configuration once in the legend, at its strongest attack, its
    loss marker at the share it keeps and its cloze marker in the same
    colour; one with no cloze gain has no triangle."""
    rows = [
        dict(config="undefended", attack=0.7, inverter=0.9, guess=0.1,
             kept_loss=1.0, kept_cloze=1.0),
        dict(config="frozen", attack=0.2, inverter=None, guess=0.12,
             kept_loss=0.8, kept_cloze=None),
    ]  # fmt: skip
    fig = figure(rows)
    try:
        (ax,) = fig.axes
        assert _legend(ax) == ["goal: kept", "guessing", "undefended", "frozen"]
        points = {c.get_label(): c for c in ax.collections if c.get_offsets().size}
        assert set(points) == {"undefended", "_undefended", "frozen"}
        assert [tuple(p) for p in points["undefended"].get_offsets()] == [(90, 100)]
        assert [tuple(p) for p in points["frozen"].get_offsets()] == [(20, 80)]
        assert tuple(points["undefended"].get_facecolor()[0]) == tuple(
            points["_undefended"].get_facecolor()[0]
        )
    finally:
        plt.close(fig)


def test_the_audit_plot_of_the_measured_cuts_matches_its_table():
    rows = _read("cuts.csv")
    fig = recovery_figure(rows)
    try:
        check_recovery_figure(fig, rows)
    finally:
        plt.close(fig)

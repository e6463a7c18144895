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
from matplotlib.collections import PathCollection
from matplotlib.container import BarContainer

from aisyn.privacy.audit import recovery_figure, series_name
from aisyn.privacy.presets import NO_NOISE_X, frontier_figure

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


def check_frontier_figure(fig, rows: list[dict]) -> None:
    forward, backward, cost = fig.axes
    for ax, direction in ((forward, "forward"), (backward, "backward")):
        mine = {
            (r["defence"], r["A_weights"]): r
            for r in rows
            if r["direction"] == direction
        }
        plotted = set()
        for c in ax.collections:
            assert isinstance(c, PathCollection)
            label = c.get_label()
            late = label.startswith("_")
            defence = label.removeprefix("_").removesuffix(" (late)")
            r = mine[(defence, "trained (late)" if late else "base (early)")]
            ((x, y),) = c.get_offsets()
            sigma = r[direction]
            assert x == (sigma if sigma else NO_NOISE_X), label
            assert y == pytest.approx(100 * r["recovery"]), label
            plotted.add((defence, r["A_weights"]))
        assert plotted == set(mine)  # every row, once
        legend = _legend(ax)
        defences = list(dict.fromkeys(r["defence"] for r in rows))
        assert legend == [*defences, "frequent token", "target"]
        # σ = 0 is drawn at a tick of its own that says so
        labels = [t.get_text() for t in ax.get_xticklabels()]
        ticks = dict(zip(ax.get_xticks(), labels, strict=True))
        assert ticks[NO_NOISE_X] == "0"
        assert "0: no Gaussian noise" in ax.get_xlabel()
    bars = [c for c in cost.containers if isinstance(c, BarContainer)]
    assert [b.get_label() for b in bars] == ["merged", "served split"]
    names = [t.get_text() for t in cost.get_yticklabels()]
    by_defence = {r["defence"]: r for r in rows}
    assert names == [d for d in by_defence if by_defence[d]["loss_cost"] is not None]
    for bar, field in zip(bars, ("loss_cost", "served_split_cost"), strict=True):
        widths = [p.get_width() for p in bar.patches]
        assert widths == pytest.approx([by_defence[n][field] for n in names])


def test_the_audit_plot_of_the_measured_cuts_matches_its_table():
    rows = _read("cuts.csv")
    fig = recovery_figure(rows)
    try:
        check_recovery_figure(fig, rows)
    finally:
        plt.close(fig)


def test_the_frontier_plot_of_the_measured_frontier_matches_its_table():
    rows = _read("frontier.csv")
    fig = frontier_figure(rows)
    try:
        check_frontier_figure(fig, rows)
    finally:
        plt.close(fig)

"""The comparison's charts: cloze accuracy per domain across regimes, and the
reference table's accuracy against rounds.

``accuracy_figure``: one group of bars per domain, one bar per regime (the
report's rows, in their order), its 95 % bootstrap interval as an error bar,
and each domain's chance level as a dashed line, so the per-node loss curves
are not the only picture of the table. ``rounds_figure``: each federated
method's accuracy after every round, a panel per partition, fusion drawn
across.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def accuracy_figure(report: dict) -> Figure:
    """Accuracy (%) of every row of ``report`` on every domain, with intervals.

    Each regime's bars carry its name as their label (the legend), and the
    chance lines theirs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names, rows = report["domains"], report["rows"]
    width = 0.8 / len(rows)
    x = np.arange(len(names))
    # the bars get 0.35 in each; the legend beside them about 3.5 in
    fig, ax = plt.subplots(figsize=(4.5 + 0.35 * len(rows) * len(names), 4.5))
    colors = plt.get_cmap("tab10" if len(rows) <= 10 else "tab20").colors
    for i, row in enumerate(rows):
        acc = np.array([100 * row[f"acc_{n}"]["accuracy"] for n in names])
        lo = np.array([100 * row[f"acc_{n}"]["ci95"][0] for n in names])
        hi = np.array([100 * row[f"acc_{n}"]["ci95"][1] for n in names])
        ax.bar(
            x + (i - (len(rows) - 1) / 2) * width,
            acc,
            width,
            yerr=np.stack([acc - lo, hi - acc]),
            capsize=2,
            label=row["regime"],
            color=colors[i % len(colors)],
        )
    for j, n in enumerate(names):
        chance = 100 * rows[0][f"acc_{n}"]["chance"]
        ax.hlines(
            chance,
            j - 0.45,
            j + 0.45,
            colors="black",
            linestyles="dashed",
            linewidth=1,
            label="chance" if j == 0 else None,
        )
    ax.set_xticks(x, [f"{n} test items" for n in names])
    ax.set_ylabel("cloze accuracy (%), 95 % interval")
    ax.set_title("accuracy per domain, by regime")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_accuracy(report: dict, png: Path) -> None:
    from aisyn.train.run import save_figure

    save_figure(accuracy_figure(report), png)


def rounds_figure(table: dict) -> Figure:
    """Accuracy against rounds: one panel per partition, a line per method and
    domain (seed mean), fusion across in black, fusion at the partition's
    parallelism in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = table["domains"]
    fed = [g for g in table["table"] if g["kind"] == "federated" and g.get("curve")]
    partitions = list(dict.fromkeys(g["partition"] for g in fed)) or ["-"]
    fig, axes = plt.subplots(
        1, len(partitions), figsize=(5 * len(partitions), 4), squeeze=False
    )
    fusion = next(g for g in table["table"] if g["kind"] == "fusion")
    styles = ["-", "--", ":", "-."]
    colors = plt.get_cmap("tab10").colors
    for ax, part in zip(axes[0], partitions, strict=True):
        for i, g in enumerate(x for x in fed if x["partition"] == part):
            rounds = [p["round"] for p in g["curve"]]
            for j, n in enumerate(names):
                ax.plot(
                    rounds, [p[n] for p in g["curve"]],
                    styles[j % len(styles)], color=colors[i % len(colors)],
                    label=f"{g['method']} {n}",
                )  # fmt: skip
        k = next((x["clients"] for x in fed if x["partition"] == part), None)
        parallel = [
            g for g in table["table"]
            if g["kind"] == "parallel-fusion" and g["clients"] == k
        ]  # fmt: skip
        for j, n in enumerate(names):
            for ref, color, label in [
                (fusion, "black", "fusion"),
                *((g, "grey", f"fusion x{k}") for g in parallel),
            ]:
                ax.axhline(
                    ref[f"acc_{n}"], color=color, linestyle=styles[j % len(styles)],
                    linewidth=0.8, label=f"{label} {n}",
                )  # fmt: skip
        ax.set_title(f"partition {part}")
        ax.set_xlabel("round")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel("cloze accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig

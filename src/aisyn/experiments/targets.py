"""The comparison's targets (a)-(e): each judged on the report's rows, and
written as a Markdown table of verdicts."""

from __future__ import annotations

from collections.abc import Sequence

from aisyn.train.run import markdown_table


def check_targets(rows: list[dict], names: Sequence[str]) -> dict:
    """The issue's targets (a)-(d) on this table: values and pass/fail."""
    by = {r["regime"]: r for r in rows}
    fusion = by.get(f"{'+'.join(names)} ft")
    fed = next((r for r in rows if r["regime"].startswith("AIsyn federated")), None)
    out: dict = {}
    if not fusion or not fed:
        return out
    chance = {n: fusion[f"acc_{n}"]["chance"] for n in names}

    def acc(regime: str, domain: str) -> float:
        """The accuracy of ``regime``'s row on ``domain``'s test items."""
        return by[regime][f"acc_{domain}"]["accuracy"]

    out["a_standalone_2x_chance"] = {
        n: {
            "accuracy": acc(f"{n} ft", n),
            "needed": 2 * chance[n],
            "pass": acc(f"{n} ft", n) >= 2 * chance[n],
        }
        for n in names
        if f"{n} ft" in by
    }
    # Split fine-tuning takes the same steps as standalone fine-tuning (to
    # float rounding), so it scores the same, item for item or nearly.
    out["e_split_equals_standalone"] = {
        n: {
            "split": acc(f"{n} split ft", n),
            "standalone": acc(f"{n} ft", n),
            "pass": abs(acc(f"{n} split ft", n) - acc(f"{n} ft", n))
            <= 2 / by[f"{n} ft"][f"acc_{n}"]["items"],
        }
        for n in names
        if f"{n} split ft" in by and f"{n} ft" in by
    }
    out["b_fed_vs_fusion_accuracy"] = {}
    out["c_fed_vs_fusion_loss"] = {}
    out["d_fed_beats_other_standalone"] = {}
    for n in names:
        fa, fu = fed[f"acc_{n}"], fusion[f"acc_{n}"]
        out["b_fed_vs_fusion_accuracy"][n] = {
            "federated": fa["accuracy"],
            "fusion": fu["accuracy"],
            "fusion_ci95": fu["ci95"],
            "pass": abs(fa["accuracy"] - fu["accuracy"]) <= 0.01
            or fu["ci95"][0] <= fa["accuracy"] <= fu["ci95"][1],
        }
        out["c_fed_vs_fusion_loss"][n] = {
            "federated": fed[f"loss_{n}"],
            "fusion": fusion[f"loss_{n}"],
            "pass": abs(fed[f"loss_{n}"] - fusion[f"loss_{n}"]) <= 0.02,
        }
        others = [m for m in names if m != n and f"{m} ft" in by]
        if not others:  # no standalone model to beat (--regimes without it)
            continue
        out["d_fed_beats_other_standalone"][n] = {
            "federated": fa["accuracy"],
            **{f"standalone {m}": acc(f"{m} ft", n) for m in others},
            "pass": all(fa["accuracy"] > acc(f"{m} ft", n) for m in others),
        }
    return out


#: each target of ``check_targets``, in the issue's order: what it asks, and
#: whether its numbers are losses (else accuracies)
TARGETS = {
    "a_standalone_2x_chance": ("(a) standalone >= 2x chance on its own domain", False),
    "b_fed_vs_fusion_accuracy": (
        "(b) federated within 1 point of fusion, or inside fusion's 95 % interval",
        False,
    ),
    "c_fed_vs_fusion_loss": (
        "(c) federated test loss within 0.02 nats of fusion's",
        True,
    ),
    "d_fed_beats_other_standalone": (
        "(d) federated beats each other domain's standalone model",
        False,
    ),
    "e_split_equals_standalone": ("(e) split fine-tuning scores as standalone", False),
}


def _fmt_target_value(key: str, value, loss: bool) -> str:
    if key.endswith("ci95"):
        lo, hi = value
        name = key.removesuffix("_ci95")
        return f"{name} 95 % interval [{100 * lo:.1f}, {100 * hi:.1f}]"
    number = f"{value:.4f}" if loss else f"{100 * value:.2f} %"
    return f"{key.replace('_', ' ')} {number}"


def targets_table(targets: dict) -> list[str]:
    """``check_targets``' verdicts as Markdown table lines: one row per target
    and domain, its numbers and whether it is met."""
    rows = []
    for key, per_domain in targets.items():
        title, loss = TARGETS.get(key, (key, False))
        for domain, verdict in per_domain.items():
            numbers = ", ".join(
                _fmt_target_value(k, v, loss) for k, v in verdict.items() if k != "pass"
            )
            rows.append(
                [title, domain, numbers, "met" if verdict["pass"] else "**not met**"]
            )
    return markdown_table(["target", "domain", "numbers", "result"], rows)

"""The comparison's report in one folder: the table as Markdown (with the
targets, the accuracy chart and every run's loss curve) and CSV, and
``report.json`` with everything the table was made from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from aisyn.experiments.accuracy_chart import plot_accuracy
from aisyn.experiments.targets import targets_table
from aisyn.train.run import markdown_table, write_csv, write_json_atomic

REPORT_MD = "report.md"
REPORT_CSV = "report.csv"
REPORT_JSON = "report.json"
ACCURACY_PNG = "accuracy.png"


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


def _fmt_acc(a: dict) -> str:
    lo, hi = a["ci95"]
    return f"{100 * a['accuracy']:.2f} % [{100 * lo:.1f}, {100 * hi:.1f}]"


def table_rows(report: dict) -> tuple[list[str], list[list[str]], list[dict]]:
    names = report["domains"]
    header = ["regime", "device", "epochs/rounds", "steps", "wall time", "final loss"]
    header += [f"Acc {n}" for n in names] + [f"test loss {n}" for n in names]
    md, flat = [], []
    for r in report["rows"]:
        wall = _fmt_time(r.get("wall_s"))
        if r.get("overhead_s") is not None:
            train_s, over_s = _fmt_time(r["train_s"]), _fmt_time(r["overhead_s"])
            wall += f" (train {train_s} + overhead {over_s})"
        if r.get("bytes_on_wire") is not None:
            wall += f" ({r['bytes_on_wire'] / 1e6:.1f} MB on the wire)"
        fl = r.get("final_loss")
        md.append(
            [
                r["regime"],
                r["device"],
                str(r["epochs_or_rounds"]),
                str(r["steps"]),
                wall,
                "-" if fl is None else f"{fl:.3f}",
                *[_fmt_acc(r[f"acc_{n}"]) for n in names],
                *[f"{r[f'loss_{n}']:.4f}" for n in names],
            ]
        )
        flat.append(
            {
                "regime": r["regime"],
                "device": r["device"],
                "epochs_or_rounds": r["epochs_or_rounds"],
                "steps": r["steps"],
                "wall_s": r.get("wall_s"),
                "train_s": r.get("train_s"),
                "overhead_s": r.get("overhead_s"),
                "bytes_on_wire": r.get("bytes_on_wire"),
                "final_loss": fl,
                **{f"acc_{n}": r[f"acc_{n}"]["accuracy"] for n in names},
                **{f"acc_{n}_ci_lo": r[f"acc_{n}"]["ci95"][0] for n in names},
                **{f"acc_{n}_ci_hi": r[f"acc_{n}"]["ci95"][1] for n in names},
                **{f"acc_{n}_items": r[f"acc_{n}"]["items"] for n in names},
                **{f"test_loss_{n}": r[f"loss_{n}"] for n in names},
                "format": r["format"],
            }
        )
    return header, md, flat


def write_report(out: Path, report: dict, plots: dict[str, Path]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    header, md_rows, flat = table_rows(report)
    plot_dir = out / "plots"
    plot_dir.mkdir(exist_ok=True)
    copied = []
    for name, src in plots.items():
        if Path(src).is_file():
            dst = plot_dir / f"{name.replace(' ', '_').replace('+', '_')}.png"
            shutil.copyfile(src, dst)
            copied.append((name, dst.relative_to(out)))
    plot_accuracy(report, plot_dir / ACCURACY_PNG)
    lines = [
        f"# Standalone vs data fusion vs federated ({', '.join(report['domains'])}; "
        f"preset `{report['preset']['name']}`)",
        "",
        *markdown_table(header, md_rows),
        "",
        "Accuracy: cloze items of each domain's test documents, 95 % bootstrap "
        "interval in brackets; the base is scored zero-shot (`lm` format), fine-tuned "
        "models in the `prompt` format they were trained on. Test loss: nats per "
        "token on each domain's raw test text. Steps: optimizer steps; the federated "
        "row counts all clients' local steps (each client ran "
        f"{report['preset']['finetune_steps'] // len(report['domains'])}).",
        "",
        "## Accuracy per domain",
        "",
        f"![accuracy per domain, by regime](plots/{ACCURACY_PNG})",
        "",
        "## Targets",
        "",
        *targets_table(report["targets"]),
        "",
        "## Loss curves",
        "",
        *[f"- {name}: ![{name}]({path})" for name, path in copied],
        "",
    ]
    (out / REPORT_MD).write_text("\n".join(lines), encoding="utf-8")
    write_csv(out / REPORT_CSV, flat)
    write_json_atomic(out / REPORT_JSON, report)


def read_report(out: str | Path) -> dict:
    path = Path(out) / REPORT_JSON
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no comparison report")
    return json.loads(path.read_text())

"""Ablation: what closes the non-IID gap between federated and data fusion.

Runs federated variants (local steps per round, FedProx mu, server momentum,
FedAdam, LoRA vs full, learning-rate schedule across rounds) on the inputs of a
comparison preset — the same cached base model, SFT data and step budget — and
scores each global model like ``aisyn experiment compare`` does. Fusion's and
the standalone models' numbers are read from a finished comparison report.

    python bench/fl_ablation.py --preset full --report reports/full \\
        --variant baseline: \\
        --variant restart:schedule=restart \\
        --variant fedprox:strategy=fedprox,proximal_mu=0.01

Prints the ablation table (Markdown) and writes OUT/ablation.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from aisyn.experiments.compare import federated_settings, prepare_inputs
from aisyn.experiments.report import read_report
from aisyn.fl.launch import simulate
from aisyn.testbed.presets import get_preset
from aisyn.train.models import load_run_model


def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    overrides: dict = {}
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        if v in ("true", "false"):
            overrides[k] = v == "true"
            continue
        for cast in (int, float):
            try:
                overrides[k] = cast(v)
                break
            except ValueError:
                continue
        else:
            overrides[k] = v
    return name, overrides


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="full")
    ap.add_argument("--domains", default="news,reviews")
    ap.add_argument("--report", required=True, help="a finished compare report folder")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--variant",
        action="append",
        required=True,
        help="NAME:key=value,key=value (FLSettings fields)",
    )
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    preset = get_preset(args.preset)
    inputs = prepare_inputs(args.domains.split(","), preset, args.device)
    names = inputs.names
    ref = read_report(args.report)
    fusion = next(r for r in ref["rows"] if r["regime"] == f"{'+'.join(names)} ft")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "ablation.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else []
    done = {r["variant"] for r in results}
    for spec in args.variant:
        name, overrides = parse_variant(spec)
        if name in done:
            print(f"{name}: already done, skipped", file=sys.stderr)
            continue
        settings = federated_settings(preset, len(names), args.device, **overrides)
        print(f"{name}: {overrides}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        fed = simulate(inputs.base, inputs.sft, out / "runs" / name, settings)
        model, _ = load_run_model(Path(fed["run"]), inputs.device)
        scores = inputs.evaluate(model, "prompt")
        results.append(
            {
                "variant": name,
                "overrides": overrides,
                "settings": settings.to_dict(),
                "wall_s": time.perf_counter() - t0,
                "train_s": sum(h.get("client_train_s") or 0 for h in fed["history"]),
                **scores,
            }
        )
        results_file.write_text(json.dumps(results, indent=2))
    header = ["variant", "rounds x E", "strategy", "method", "schedule"]
    header += [
        f"Acc {n} (fusion {100 * fusion[f'acc_{n}']['accuracy']:.1f})" for n in names
    ]
    header += [f"test loss {n} (fusion {fusion[f'loss_{n}']:.3f})" for n in names]
    header += ["wall"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        s = r["settings"]
        extra = {
            "fedprox": f" mu={s['proximal_mu']}",
            "fedavgm": f" lr={s['server_lr']} m={s['server_momentum']}",
            "fedadam": f" eta={s['eta']}",
        }.get(s["strategy"], "")
        cells = [
            r["variant"],
            f"{s['rounds']} x {s['local_steps']}",
            s["strategy"] + extra,
            s["method"],
            s["schedule"],
        ]
        for n in names:
            a = r[f"acc_{n}"]
            d = 100 * (a["accuracy"] - fusion[f"acc_{n}"]["accuracy"])
            cells.append(f"{100 * a['accuracy']:.2f} % ({d:+.1f})")
        for n in names:
            cells.append(
                f"{r[f'loss_{n}']:.4f} ({r[f'loss_{n}'] - fusion[f'loss_{n}']:+.3f})"
            )
        cells.append(f"{r['wall_s'] / 60:.1f} min")
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (out / "ablation.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

With ``--table DIR`` (a reference table's folder, finished or not) each
variant runs as the table's federations do -- in this process, over
``--partition``, for ``--seed``, its global model scored after every round --
against that table's fusion run, whose score comes from the table's cache:

    python bench/fl_ablation.py --preset reference --table reports/reference \
        --out reports/ablation-ref \\
        --variant server-lr-2:strategy=fedavgm,server_lr=2,server_momentum=0

``--partition dirichlet-1000 --clients 2`` deals the domains' items to two
clients in near-equal shares of each: an IID federation, the control that
tells what averaging parallel clients costs without non-IID data.

Prints the ablation table (Markdown) and writes OUT/ablation.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from aisyn.experiments.compare import federated_settings, prepare_inputs
from aisyn.experiments.evaluator import ScoreCache
from aisyn.experiments.report import read_report
from aisyn.experiments.table import SCORES, federated_row, partition_clients
from aisyn.fl.launch import simulate
from aisyn.testbed.presets import get_preset
from aisyn.train.models import load_run_model
from aisyn.validate import holds_run


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
    ref = ap.add_mutually_exclusive_group(required=True)
    ref.add_argument("--report", help="a finished compare report folder")
    ref.add_argument("--table", help="a reference table's folder")
    ap.add_argument("--partition", default="domains", help="with --table")
    ap.add_argument("--seed", type=int, default=1, help="with --table")
    ap.add_argument(
        "--clients",
        type=int,
        default=None,
        help="with --table and a Dirichlet --partition: clients dealt (the "
        "preset's); a deal the table does not hold is made under --out",
    )
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--variant",
        action="append",
        required=True,
        help="NAME:key=value,key=value (FLSettings fields)",
    )
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    if args.clients is not None and args.clients < 2:
        ap.error(f"--clients must be >= 2, got {args.clients}")
    preset = get_preset(args.preset)
    inputs = prepare_inputs(args.domains.split(","), preset, args.device)
    names = inputs.names
    if args.table:
        table = Path(args.table)
        inputs = replace(inputs, evaluate=ScoreCache(inputs.evaluate, table / SCORES))
        runs = table / "runs" / f"seed-{args.seed}"
        fusion = inputs.evaluate(
            load_run_model(runs / "fusion", inputs.device)[0], "prompt"
        )
        k = args.clients or preset.clients
        table_deal = args.partition in preset.partitions and k == preset.clients
        clients = partition_clients(
            args.partition, inputs, runs if table_deal else Path(args.out), k, args.seed
        )
    else:
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
        print(f"{name}: {overrides}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        if args.table:
            result = in_table(
                inputs, preset, clients, args, out / "runs" / name, overrides
            )
        else:
            settings = federated_settings(preset, len(names), args.device, **overrides)
            fed = simulate(inputs.base, inputs.sft, out / "runs" / name, settings)
            model, _ = load_run_model(Path(fed["run"]), inputs.device)
            result = {
                "settings": settings.to_dict(),
                "train_s": sum(h.get("client_train_s") or 0 for h in fed["history"]),
                **inputs.evaluate(model, "prompt"),
            }
        results.append(
            {
                "variant": name,
                "overrides": overrides,
                "wall_s": time.perf_counter() - t0,
                **result,
            }
        )
        results_file.write_text(json.dumps(results, indent=2))
    header = ["variant", "rounds x E", "strategy", "method", "schedule, local AdamW"]
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
            f"{s['rounds']} x {s['local_epochs']:.4g} epochs"
            if s.get("local_epochs")
            else f"{s['rounds']} x {s['local_steps']}",
            s["strategy"] + extra,
            s["method"],
            f"{s['schedule']}, {s.get('local_optimizer', 'fresh')}",
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


def in_table(inputs, preset, clients: dict, args, runs: Path, overrides: dict) -> dict:
    """One variant as the table runs a federation: its scores (the table's
    way, from its cache), its settings and its accuracy after every round."""
    strategy = overrides.pop("strategy", preset.strategy)
    row = federated_row(
        inputs, preset, clients, args.partition, strategy, args.seed, runs,
        holds_run(runs / "federated" / f"{strategy}-{args.partition}" / "server"),
        **overrides,
    )  # fmt: skip
    overrides["strategy"] = strategy
    server = runs / "federated" / f"{strategy}-{args.partition}" / "server"
    settings = federated_settings(
        preset, len(clients), args.device, seed=args.seed, **overrides
    )
    return {
        "settings": settings.to_dict(),
        "curve": row["curve"],
        **inputs.evaluate(load_run_model(server, inputs.device)[0], "prompt"),
    }


if __name__ == "__main__":
    sys.exit(main())

"""Robust aggregation: its accuracy cost without an attacker, its effect with one.

On the inputs of a comparison preset (the same cached base model and SFT data as
``aisyn experiment compare``), each domain's training items are dealt into
``--parts`` clients, and one extra client joins. Attacks (the extra client):

* ``none``: it is honest (so every scenario has the same number of clients);
* ``flip-x1000``: it trains honestly, then sends its update sign-flipped and
  scaled x1000 — what the norm bound is for;
* ``flip-bound``: sign-flipped and scaled 2.7x, just inside the default norm
  bound (3 x the round's median update norm), and it claims 2**62 examples:
  the strongest update the guard lets through, left to the aggregation.

Each aggregation variant (``aisyn.fl.settings`` keys, as ``bench/fl_ablation.py``
takes them) runs against each attack; every final global model is scored like
the comparison scores models (cloze accuracy and test loss per domain).

The federation runs in this process: the real ServerApp code
(``aisyn.fl.server.run_server``) drives the guarded Flower strategy over an
in-memory grid whose nodes answer with the real ClientApp
(``aisyn.fl.client_app.app``). Only the attacker's reply is changed, after its
ClientApp built it, so the shipped client has no attack hook. Clients run one
after another (``--threads`` torch threads), so the run is deterministic.

Each client trains ``finetune_steps // clients // rounds`` local steps per round
(the comparison's equal step budget, spread over all clients).

    python bench/fl_robust.py --preset ci --out /tmp/fl_robust
    python bench/fl_robust.py --preset full --out reports/fl_robust

Prints the table (Markdown) and writes OUT/robust.{md,json}; a rerun skips the
(variant, attack) pairs already in robust.json and redoes unfinished ones.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from fl_ablation import parse_variant  # same NAME:key=value,... variants
from flwr.app import Array, ArrayRecord, Message, MessageType
from flwr.supercore.task_identity import TaskIdentity

from aisyn.experiments.compare import federated_settings, prepare_inputs
from aisyn.fl.in_process import RUN_ID, InProcessGrid
from aisyn.fl.partition import partition_iid
from aisyn.fl.records import WEIGHT_KEY
from aisyn.fl.server import ServerNode, run_server
from aisyn.testbed.presets import get_preset
from aisyn.train.models import load_run_model

ATTACKS = ("none", "flip-x1000", "flip-bound")
# scale of the attacker's (sign-flipped) update; flip-bound stays just inside
# the default max-norm-ratio of 3 (its own honest norm ~ the round's median)
SCALE = {"flip-x1000": -1000.0, "flip-bound": -2.7}
VARIANTS = (
    "mean-unbounded:aggregation=mean,max_norm_ratio=0",
    "mean:aggregation=mean",
    "trimmed-mean:aggregation=trimmed-mean,trim_fraction=0.2",
    "median:aggregation=median",
    "krum:aggregation=krum,assumed_attackers=1",
    "multikrum:aggregation=multikrum,assumed_attackers=1",
    "bulyan:aggregation=bulyan,assumed_attackers=1",
)


def poison(reply: Message, sent: Message, attack: str) -> Message:
    """The attacker's reply: its honest update, sign-flipped and scaled."""
    base = {k: a.numpy() for k, a in sent.content["arrays"].items()}
    trained = {k: a.numpy() for k, a in reply.content["arrays"].items()}
    scale = SCALE[attack]
    reply.content["arrays"] = ArrayRecord(
        {
            k: Array((base[k] + scale * (v - base[k])).astype(np.float32))
            for k, v in trained.items()
        }
    )
    if attack == "flip-bound":
        reply.content.metric_records["metrics"][WEIGHT_KEY] = 2**62
    return reply


def attacker(node_id: int, attack: str):
    """The ``answer`` of an in-process grid whose node ``node_id`` poisons its
    train replies with ``attack``."""

    def answer(node: int, msg: Message, reply: Message) -> Message:
        poisoned = (
            node == node_id
            and attack != "none"
            and msg.metadata.message_type == MessageType.TRAIN
            and not reply.has_error()
        )
        return poison(reply, msg, attack) if poisoned else reply

    return answer


def client_parts(inputs, parts: int, out: Path) -> list[tuple[str, Path]]:
    """Each domain's items dealt into ``parts`` clients (cached under OUT/data)."""
    clients = []
    for name in inputs.names:
        folder = out / "data" / name
        if not (folder / f"part{parts - 1}" / "manifest.json").is_file():
            partition_iid([inputs.sft[name]], folder, parts, seed=0)
        clients += [(f"{name}{i}", folder / f"part{i}") for i in range(parts)]
    return clients


def run_one(inputs, preset, clients, settings_kw, attack, run_dir: Path) -> dict:
    n = len(clients) + 1
    settings = federated_settings(
        preset,
        len(inputs.names),
        str(inputs.device),
        local_steps=max(1, preset.finetune_steps // n // preset.rounds),
        min_clients=n,
        **settings_kw,
    )
    # the extra client holds the first client's data: honest, it is one more
    # client of that domain; as an attacker, it knows what honest updates look like
    members = [*clients, ("extra", clients[0][1])]
    nodes = {
        i: {
            "name": name,
            "data": str(data),
            "base": str(inputs.base),
            "out": str(run_dir / "clients" / name),
        }
        for i, (name, data) in enumerate(members, start=1)
    }
    # Flower stamps the messages the strategy builds with the running task's IDs
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, 0, 1
    t0 = time.perf_counter()
    result = run_server(
        settings,
        ServerNode(inputs.base, run_dir / "server"),
        InProcessGrid(nodes, attacker(n, attack)),
    )
    wall_s = time.perf_counter() - t0
    model, _ = load_run_model(Path(result["run"]), inputs.device)
    return {
        "settings": settings.to_dict(),
        "clients": n,
        "wall_s": wall_s,
        "rejected": sum(len(h.get("rejected", [])) for h in result["history"]),
        # rounds that kept the last global model (nothing, or a bad aggregate)
        "rounds_kept": sum(
            1
            for h in result["history"]
            if h.get("aggregate_s") == 0 or "aggregate_rejected" in h
        ),
        "final_global_valid_loss": result["final_global_valid_loss"],
        **inputs.evaluate(model, "prompt"),
    }


def table(results: list[dict], names: list[str]) -> str:
    baseline = {
        r["variant"]: r for r in results if r["attack"] == "none"
    }  # the same aggregation without an attacker
    header = ["aggregation", "attack"]
    header += [f"Acc {n}" for n in names] + [f"test loss {n}" for n in names]
    header += ["rejected", "wall"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ref = baseline.get("mean")
    for r in results:
        # no attack: the change from the plain mean; with one: from no attack
        b = ref if r["attack"] == "none" else baseline.get(r["variant"])
        cells = [r["variant"], r["attack"]]
        for n in names:
            a = r[f"acc_{n}"]["accuracy"]
            d = "" if b is None else f" ({100 * (a - b[f'acc_{n}']['accuracy']):+.1f})"
            cells.append(f"{100 * a:.2f} %{d}")
        for n in names:
            loss = r[f"loss_{n}"]
            d = "" if b is None else f" ({loss - b[f'loss_{n}']:+.3f})"
            cells.append(f"{loss:.4f}{d}")
        cells += [str(r["rejected"]), f"{r['wall_s'] / 60:.1f} min"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="ci")
    ap.add_argument("--domains", default="news,reviews")
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", type=int, default=3, help="clients per domain")
    ap.add_argument(
        "--variant",
        action="append",
        help="NAME:key=value,... (FLSettings fields; default: mean, robust ones)",
    )
    ap.add_argument("--attack", action="append", choices=ATTACKS)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s:%(name)s:%(message)s"
    )
    logging.getLogger("flwr").setLevel(logging.WARNING)  # per-round chatter
    torch.set_num_threads(args.threads)
    preset = get_preset(args.preset)
    inputs = prepare_inputs(args.domains.split(","), preset, args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clients = client_parts(inputs, args.parts, out)
    results_file = out / "robust.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else []
    done = {(r["variant"], r["attack"]) for r in results}
    for spec in args.variant or VARIANTS:
        name, overrides = parse_variant(spec)
        for attack in args.attack or ATTACKS:
            if (name, attack) in done:
                print(f"{name} / {attack}: already done, skipped", file=sys.stderr)
                continue
            print(f"{name} / {attack}: {overrides}", file=sys.stderr, flush=True)
            run_dir = out / "runs" / f"{name}-{attack}"
            shutil.rmtree(run_dir, ignore_errors=True)  # unfinished: not in the json
            row = run_one(inputs, preset, clients, overrides, attack, run_dir)
            results.append({"variant": name, "attack": attack, **row})
            results_file.write_text(json.dumps(results, indent=2))
    text = table(results, inputs.names)
    (out / "robust.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``aisyn privacy audit``: play the honest-but-curious compute party of a
split run and report how much of the data party's text it recovers.

For each cut, A's model (the base, or a run fine-tuned from it: "early" and
"late" in training) computes one training step's worth of what crosses on
rows of A's private data: the front cut's activations, B's output and the
gradient A returns for it. B then attacks with the weights it knows — the
public base's ("base known") or, for comparison, another model of the same
shape ("base unknown") — using each attack of ``attacks.py``. Recovery is the
share of positions whose token (forward: A's input; backward: A's label, the
next token) is guessed exactly, beside what always guessing the most frequent
token gets.

Writes ``audit.md``, ``audit.csv``, ``audit.json`` and ``recovery.png``
(recovery against the blocks A keeps on that side of B) to ``--out``.
"""

from __future__ import annotations

import csv
import json
import logging
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from aisyn.data.shards import TokenShards
from aisyn.model.causal_lm import CausalLM
from aisyn.model.families import build_model
from aisyn.model.segments import Partition, parse_partition
from aisyn.privacy.attacks import (
    LearnedDecoder,
    context_decoder,
    frequent_token_rate,
    infer_labels,
    invert_activations,
    recovery,
)
from aisyn.split.calibration import blocks_of, cut_traffic
from aisyn.train.models import load_run_model

log = logging.getLogger(__name__)


@dataclass
class AuditSettings:
    samples: int = 8  # rows of A's test split attacked
    public_samples: int = 256  # rows of public text B trains its decoders on
    steps: int = 200  # optimisation steps of the white-box attacks
    seed: int = 0


@dataclass
class Crossing:
    """What B sees of one batch, and the truth it tries to recover."""

    inputs: torch.Tensor  # (B, T) A's tokens
    labels: torch.Tensor  # (B, T) the next tokens
    acts: torch.Tensor  # (B, T, C) front cut activations (A -> B)
    out: torch.Tensor  # (B, T, C) B's output
    grad: torch.Tensor  # (B, T, C) gradient of the loss w.r.t. ``out`` (A -> B)


def crossing(model: CausalLM, rows: torch.Tensor, partition: Partition) -> Crossing:
    """One step's traffic of a split run of ``model`` on ``rows`` (B, T+1)."""
    acts, out, grad = cut_traffic(model, rows, partition)
    return Crossing(rows[:, :-1], rows[:, 1:], acts, out, grad)


def public_crossing(
    model: CausalLM, rows: torch.Tensor, partition: Partition, batch: int = 32
) -> Crossing:
    """B's training material for the learned decoders: public rows run through
    the model B knows, as A's would be, ``batch`` rows at a time."""
    parts = [
        crossing(model, rows[i : i + batch], partition)
        for i in range(0, len(rows), batch)
    ]
    return Crossing(
        *(torch.cat([getattr(c, f.name) for c in parts]) for f in fields(Crossing))
    )


def learned_decoders(
    public: Crossing, vocab: int
) -> dict[tuple[str, str], LearnedDecoder]:
    """B's learned attacks, by (attack, direction), fitted on what ``public``
    rows send: each ``predict``s tokens from the activations (forward) or
    the gradient (backward) it is given."""
    dim = public.acts.shape[-1]
    return {
        ("learned", "forward"): LearnedDecoder(dim, vocab).fit(
            public.acts, public.inputs
        ),
        ("learned in context", "forward"): context_decoder(
            public.acts, public.inputs, vocab
        ),
        ("learned", "backward"): LearnedDecoder(dim, vocab, normalise=True).fit(
            public.grad, public.labels
        ),
    }


def audit(
    base: str | Path,
    data: str | Path,
    public: str | Path,
    out: str | Path,
    cuts: list[str],
    *,
    trained: str | Path | None = None,
    settings: AuditSettings | None = None,
) -> dict:
    """Run every attack on every cut; write and return the report."""
    s = settings or AuditSettings()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty; choose another --out")
    t0 = time.perf_counter()
    torch.manual_seed(s.seed)
    base_model, base_cfg = load_run_model(base)
    cfg = base_model.config
    partitions = [parse_partition(c, cfg) for c in cuts]  # bad cuts fail first
    sha = base_cfg["tokenizer"]["sha256"]
    private = TokenShards.open(data, "test", tokenizer_sha256=sha)
    pub = TokenShards.open(public, "train", tokenizer_sha256=sha)
    g = torch.Generator().manual_seed(s.seed)
    rows = private.batch(torch.randperm(len(private), generator=g)[: s.samples])
    pub_rows = pub.batch(torch.randperm(len(pub), generator=g)[: s.public_samples])
    # "base unknown": B's guess of the weights is another model of this shape.
    stranger = build_model(cfg, seed=s.seed + 1).eval()
    victims = {"base (early)": base_model}
    if trained is not None:
        victims["fine-tuned (late)"] = load_run_model(trained)[0]
    for m in (base_model, stranger, *victims.values()):
        m.eval().requires_grad_(False)

    results = []

    def add(cut, weights, knows, attack, direction, guess, truth):
        results.append(
            {
                "cut": cut.spec,
                "front_blocks_on_A": cut.front,
                "back_blocks_on_A": cut.back or 0,
                "A_weights": weights,
                "B_knows": knows,
                "attack": attack,
                "direction": direction,
                "recovery": recovery(guess, truth),
                "frequent_token": frequent_token_rate(truth),
            }
        )
        log.info("%s", json.dumps(results[-1]))

    for cut in partitions:
        first, _, back = blocks_of(cut)
        learned = None
        for weights, victim in victims.items():
            seen = crossing(victim, rows, cut)
            for knows, attacker in (("base", base_model), ("nothing", stranger)):
                guess = invert_activations(attacker, seen.acts, first, steps=s.steps)
                add(cut, weights, knows, "white-box", "forward", guess, seen.inputs)
                guess = infer_labels(attacker, seen.out, seen.grad, back, steps=s.steps)
                add(cut, weights, knows, "white-box", "backward", guess, seen.labels)
            if learned is None:  # B's decoders, fitted once per cut on public text
                public_seen = public_crossing(base_model, pub_rows, cut)
                learned = learned_decoders(public_seen, cfg.vocab_size)
            for (attack, direction), decoder in learned.items():
                forward = direction == "forward"
                guess = decoder.predict(seen.acts if forward else seen.grad)
                truth = seen.inputs if forward else seen.labels
                add(cut, weights, "base", attack, direction, guess, truth)
    report = {
        "base": str(base),
        "data": str(data),
        "public": str(public),
        "trained": str(trained) if trained else None,
        "model": cfg.to_dict(),
        "settings": asdict(s),
        "rows": results,
        "elapsed_s": time.perf_counter() - t0,
    }
    write_report(out, report)
    return report


HEADER = [
    "cut",
    "A's weights",
    "B knows",
    "attack",
    "direction",
    "recovery",
    "frequent token",
]


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = report["rows"]
    lines = [
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    for r in rows:
        lines.append(
            f"| {r['cut']} | {r['A_weights']} | {r['B_knows']} | {r['attack']} | "
            f"{r['direction']} | {100 * r['recovery']:.1f} % | "
            f"{100 * r['frequent_token']:.1f} % |"
        )
    s = report["settings"]
    (out / "audit.md").write_text(
        "# What the compute party recovers\n\n"
        f"{s['samples']} rows of {report['data']} (test split), attacks with "
        f"{s['steps']} optimisation steps, decoders fitted on {s['public_samples']} "
        f"rows of {report['public']}.\n\n" + "\n".join(lines) + "\n",
        encoding="utf-8",
    )
    with (out / "audit.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "audit.json").write_text(json.dumps(report, indent=2))
    plot(out / "recovery.png", rows)


def series_name(r: dict) -> str:
    """The legend entry of one attack's series: the row fields it plots."""
    return f"{r['attack']}, B knows {r['B_knows']}, A {r['A_weights']}"


def recovery_figure(rows: list[dict]):
    """Recovery against the blocks A keeps on each side of B: one line per
    attack, B's knowledge and A's weights, in each panel's own legend. A
    series keeps its colour (attack and B's knowledge) in both panels; A's
    fine-tuned weights are dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({(r["attack"], r["B_knows"]) for r in rows})
    colour = {k: plt.cm.tab10(i % 10) for i, k in enumerate(kinds)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.5), sharey=True)
    for ax, direction, key in (
        (axes[0], "forward", "front_blocks_on_A"),
        (axes[1], "backward", "back_blocks_on_A"),
    ):
        series: dict[str, list[dict]] = {}
        for r in rows:
            if r["direction"] == direction:
                series.setdefault(series_name(r), []).append(r)
        for name, rs in sorted(series.items()):
            rs.sort(key=lambda r: r[key])
            ax.plot(
                [r[key] for r in rs],
                [100 * r["recovery"] for r in rs],
                marker="o",
                color=colour[(rs[0]["attack"], rs[0]["B_knows"])],
                linestyle="-" if rs[0]["A_weights"].startswith("base") else "--",
                label=name,
            )
        base = [100 * r["frequent_token"] for r in rows if r["direction"] == direction]
        if base:
            ax.axhline(max(base), color="grey", linestyle=":", label="frequent token")
        xs = sorted({r[key] for r in rows if r["direction"] == direction})
        ax.set_xticks(xs)
        ax.set_xlabel(
            f"blocks A keeps {'before' if direction == 'forward' else 'after'} B"
        )
        ax.set_title(f"{direction}: {'inputs' if direction == 'forward' else 'labels'}")
        ax.set_ylim(-2, 102)
        # below the panel, where it covers no line
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    axes[0].set_ylabel("tokens recovered (%)")
    fig.tight_layout()
    return fig


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib.pyplot as plt

    fig = recovery_figure(rows)
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""``aisyn privacy audit``: play the honest-but-curious compute party of a
split run and report how much of the data party's text it recovers.

For each cut, A's model (the base, or a run fine-tuned from it: "early" and
"late" in training) computes one training step's worth of what crosses on
rows of A's private data: the front cut's activations, B's output and the
gradient A returns for it. B then attacks with the weights it knows — the
public base's ("base known") or, for comparison, another model of the same
shape ("base unknown") — using each attack of ``attacks.py`` and the trained
ones of ``inverters.py`` (a sequence inverter, its known-plaintext bound
fitted further on rows of A's *train* split, and similarity inference).
Recovery is the share of positions whose token (forward: A's input;
backward: A's label, the next token) is guessed exactly, beside what always
guessing the most frequent token gets; None where nothing crossed in that
direction.

Writes ``audit.md``, ``audit.csv``, ``audit.json`` and ``recovery.png``
(recovery against the blocks A keeps on that side of B) to ``--out``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from aisyn.data.shards import TokenShards
from aisyn.model.causal_lm import CausalLM
from aisyn.model.families import build_model
from aisyn.model.segments import Partition, parse_partition
from aisyn.privacy.attacks import (
    LearnedDecoder,
    base_head_labels,
    context_decoder,
    frequent_token_rate,
    infer_labels,
    invert_activations,
    recovery,
)
from aisyn.privacy.inverters import (
    InverterSettings,
    SequenceInverter,
    SimilarityInference,
    known_plaintext,
)
from aisyn.split.defence.calibration import blocks_of, cut_traffic
from aisyn.train.models import load_run_model
from aisyn.train.run import markdown_table, write_csv

log = logging.getLogger(__name__)


@dataclass
class AuditSettings:
    samples: int = 8  # rows of A's test split attacked
    public_samples: int = 256  # rows of public text B trains its decoders on
    steps: int = 200  # optimisation steps of the white-box attacks
    seed: int = 0
    # B's sequence inverter and the known-plaintext bound (A's own pairs, from
    # the train split of A's data: never the rows attacked)
    inverter: InverterSettings = field(default_factory=InverterSettings)


@dataclass
class Crossing:
    """What B sees of one batch, and the truth it tries to recover."""

    inputs: torch.Tensor  # (B, T) A's tokens
    labels: torch.Tensor  # (B, T) the next tokens
    # None where nothing crosses in that direction (a mode in which A returns
    # no gradient): the attacks on it then report nothing, and no error
    acts: torch.Tensor | None  # (B, T, C) front cut activations (A -> B)
    out: torch.Tensor | None  # (B, T, C) B's output
    grad: torch.Tensor | None  # (B, T, C) gradient of the loss w.r.t. ``out``


def crossing(
    model: CausalLM, rows: torch.Tensor, partition: Partition, send=None
) -> Crossing:
    """One step's traffic of a split run of ``model`` on ``rows`` (B, T+1);
    ``send``: the forward defence (``cut_traffic``), B's output and the
    gradient then those of what crossed."""
    acts, out, grad = cut_traffic(model, rows, partition, send=send)
    return Crossing(rows[:, :-1], rows[:, 1:], acts, out, grad)


def public_crossing(
    model: CausalLM,
    rows: torch.Tensor,
    partition: Partition,
    batch: int = 32,
    send=None,
) -> Crossing:
    """B's training material for the learned decoders: public rows run through
    the model B knows, as A's would be, ``batch`` rows at a time."""
    return concat(
        [
            crossing(model, rows[i : i + batch], partition, send)
            for i in range(0, len(rows), batch)
        ]
    )


def concat(parts: list[Crossing]) -> Crossing:
    """The rows of ``parts``, one after another (None stays None)."""
    return Crossing(
        *(
            None
            if getattr(parts[0], f.name) is None
            else torch.cat([getattr(c, f.name) for c in parts])
            for f in fields(Crossing)
        )
    )


#: what an attack reports for a direction in which nothing crossed
NOTHING_CROSSED = "nothing crossed"


def feature(c: Crossing, direction: str) -> torch.Tensor | None:
    """What B attacks in ``direction``: the activations (forward) or the
    returned gradient (backward); None where nothing crossed."""
    return c.acts if direction == "forward" else c.grad


def truth(c: Crossing, direction: str) -> torch.Tensor:
    """What B tries to recover in ``direction``: A's inputs or its labels."""
    return c.inputs if direction == "forward" else c.labels


def learned_decoders(
    public: Crossing,
    vocab: int,
    inverter: InverterSettings | None = None,
    *,
    seed: int = 0,
    more_public: Crossing | None = None,
) -> dict[tuple[str, str], object | None]:
    """B's trained attacks, by (attack, direction), fitted on what ``public``
    rows send: each ``predict``s tokens from the activations (forward) or
    the gradient (backward) it is given. An attack whose direction sent
    nothing is None. ``inverter``: the sequence inverter's size and steps;
    ``more_public``: further public rows that only the sequence inverter and
    the similarity references read (cheap per row, unlike the others)."""
    s = inverter or InverterSettings()
    every = public if more_public is None else concat([public, more_public])

    def sequence_inverter(feats, tokens, normalise=False):
        return SequenceInverter(
            feats.shape[-1],
            vocab,
            feats.shape[1],
            width=s.width,
            layers=s.layers,
            heads=s.heads,
            normalise=normalise,
            seed=seed,
        ).fit(feats, tokens, steps=s.steps, lr=s.lr, batch=s.batch, seed=seed)

    def dim(x):
        return x.shape[-1]

    builders = {
        ("learned", "forward"): lambda x, y: LearnedDecoder(dim(x), vocab).fit(x, y),
        ("learned in context", "forward"): lambda x, y: context_decoder(x, y, vocab),
        ("sequence inverter", "forward"): sequence_inverter,
        ("similarity", "forward"): lambda x, y: SimilarityInference(vocab).fit(x, y),
        ("learned", "backward"): lambda x, y: LearnedDecoder(
            dim(x), vocab, normalise=True
        ).fit(x, y),
        ("similarity", "backward"): lambda x, y: SimilarityInference(
            vocab, normalise=True
        ).fit(x, y),
    }
    decoders: dict[tuple[str, str], object | None] = {}
    for (attack, direction), build in builders.items():
        material = every if attack in ("sequence inverter", "similarity") else public
        x = feature(material, direction)
        decoders[attack, direction] = (
            None if x is None else build(x, truth(material, direction))
        )
    return decoders


def known_plaintext_decoder(
    learned: dict[tuple[str, str], object | None],
    own: Crossing | None,
    inverter: InverterSettings | None = None,
    *,
    seed: int = 0,
) -> dict[tuple[str, str], object | None]:
    """The known-plaintext bound: B's public sequence inverter fine-tuned on
    ``own``, A's own (text, activation) pairs through the same mechanism
    (rows other than those attacked). Nothing when ``own`` is None."""
    if own is None:
        return {}
    s = inverter or InverterSettings()
    public_only = learned.get(("sequence inverter", "forward"))
    tuned = None
    if public_only is not None and own.acts is not None:
        tuned = known_plaintext(
            public_only,
            own.acts,
            own.inputs,
            steps=s.known_steps,
            lr=s.lr,
            batch=s.batch,
            seed=seed,
        )
    return {("known plaintext", "forward"): tuned}


def decoded(
    decoders: dict[tuple[str, str], object | None], seen: Crossing
) -> dict[tuple[str, str], torch.Tensor | None]:
    """Each decoder's guesses on ``seen``; None where the decoder or what it
    reads is missing (nothing crossed in its direction)."""
    out = {}
    for (attack, direction), decoder in decoders.items():
        x = feature(seen, direction)
        out[attack, direction] = (
            None if decoder is None or x is None else decoder.predict(x)
        )
    return out


def draw(shards: TokenShards, n: int, g: torch.Generator) -> torch.Tensor:
    """Up to ``n`` rows of ``shards``, drawn at random with ``g``."""
    return shards.batch(torch.randperm(len(shards), generator=g)[:n])


@dataclass
class Drawn:
    """The rows an audit reads, drawn in this order by one generator (named
    as ``yardstick.Inputs`` takes them)."""

    rows: torch.Tensor  # A's test rows attacked
    public_rows: torch.Tensor  # public rows B fits its decoders on
    # further public rows, for the inverter and the similarity references only
    more_public: torch.Tensor | None
    # A's *train* rows (never the test rows attacked): the pairs the
    # known-plaintext attacker holds; None without that attack
    known_rows: torch.Tensor | None


def draw_rows(
    data: str | Path, public: str | Path, sha: str, s: AuditSettings
) -> Drawn:
    """The rows of ``data`` (A's) and ``public`` an audit with ``s`` reads,
    from shards of the tokenizer ``sha``, drawn with ``s.seed``."""
    g = torch.Generator().manual_seed(s.seed)
    rows = draw(TokenShards.open(data, "test", tokenizer_sha256=sha), s.samples, g)
    pub = TokenShards.open(public, "train", tokenizer_sha256=sha)
    drawn = torch.randperm(len(pub), generator=g)
    more = drawn[s.public_samples : s.inverter.public_rows]
    known = None
    if s.inverter.known_pairs:
        train = TokenShards.open(data, "train", tokenizer_sha256=sha)
        known = draw(train, s.inverter.known_pairs, g)
    return Drawn(
        rows,
        pub.batch(drawn[: s.public_samples]),
        pub.batch(more) if len(more) else None,
        known,
    )


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
    drawn = draw_rows(data, public, base_cfg["tokenizer"]["sha256"], s)
    rows, known_rows = drawn.rows, drawn.known_rows
    # "base unknown": B's guess of the weights is another model of this shape.
    stranger = build_model(cfg, seed=s.seed + 1).eval()
    victims = {"base (early)": base_model}
    if trained is not None:
        victims["fine-tuned (late)"] = load_run_model(trained)[0]
    for m in (base_model, stranger, *victims.values()):
        m.eval().requires_grad_(False)

    results = []

    def add(cut, weights, knows, attack, direction, guess, seen):
        truth_ = truth(seen, direction)
        results.append(
            {
                "cut": cut.spec,
                "front_blocks_on_A": cut.front,
                "back_blocks_on_A": cut.back or 0,
                "A_weights": weights,
                "B_knows": knows,
                "attack": attack,
                "direction": direction,
                # None: nothing crossed in that direction to attack
                "recovery": None if guess is None else recovery(guess, truth_),
                "frequent_token": frequent_token_rate(truth_),
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
                add(cut, weights, knows, "white-box", "forward", guess, seen)
                guess = None
                if seen.grad is not None:
                    guess = infer_labels(
                        attacker, seen.out, seen.grad, back, steps=s.steps
                    )
                add(cut, weights, knows, "white-box", "backward", guess, seen)
            # no gradient needed: B's own output through the base's head
            guess = base_head_labels(base_model, seen.out, back)
            add(cut, weights, "base", "base head", "backward", guess, seen)
            if learned is None:  # B's decoders, fitted once per cut on public text
                public_seen = public_crossing(
                    base_model, drawn.public_rows, cut, len(rows)
                )
                more = (
                    None
                    if drawn.more_public is None
                    else public_crossing(base_model, drawn.more_public, cut, len(rows))
                )
                learned = learned_decoders(
                    public_seen,
                    cfg.vocab_size,
                    s.inverter,
                    seed=s.seed,
                    more_public=more,
                )
            # the known-plaintext bound: pairs from this victim (A's own map)
            own = (
                None
                if known_rows is None
                else public_crossing(victim, known_rows, cut, len(rows))
            )
            known = known_plaintext_decoder(learned, own, s.inverter, seed=s.seed)
            for (attack, direction), guess in decoded(
                {**learned, **known}, seen
            ).items():
                add(cut, weights, "base", attack, direction, guess, seen)
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


def _percent(v: float | None) -> str:
    return NOTHING_CROSSED if v is None else f"{100 * v:.1f} %"


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = report["rows"]
    lines = markdown_table(
        HEADER,
        [
            [
                r["cut"],
                r["A_weights"],
                r["B_knows"],
                r["attack"],
                r["direction"],
                _percent(r["recovery"]),
                f"{100 * r['frequent_token']:.1f} %",
            ]
            for r in rows
        ],
    )
    s = report["settings"]
    inv = s["inverter"]
    (out / "audit.md").write_text(
        "# What the compute party recovers\n\n"
        f"{s['samples']} rows of {report['data']} (test split), attacks with "
        f"{s['steps']} optimisation steps, decoders fitted on {s['public_samples']} "
        f"rows of {report['public']} (the sequence inverter: {inv['layers']} "
        f"layers of width {inv['width']}, {inv['steps']} steps; the known-plaintext "
        f"bound adds {inv['known_pairs']} rows of A's train split, "
        f"{inv['known_steps']} steps).\n\n" + "\n".join(lines) + "\n",
        encoding="utf-8",
    )
    write_csv(out / "audit.csv", rows)
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
            if r["direction"] == direction and r["recovery"] is not None:
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

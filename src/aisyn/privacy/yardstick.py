"""The yardstick of a defence: what it keeps of fine-tuning's gain where
fine-tuning matters, and what the compute party still recovers.

The base has never seen A's domain: it is pretrained on the public domain
only (reviews), and A fine-tunes it on its private supervised cloze items
(news) with split training. Each configuration of ``aisyn split train`` (a
cut defence, a frozen backbone, a private warm-up, ...) is one real split
run from that base; its merged model is scored on A's domain twice -- the LM
loss of the answers of A's held-out items and the accuracy on A's cloze test
items -- and its share of the undefended run's gain is

    kept = (base - defended) / (base - undefended)      (loss)
    kept = (defended - base) / (undefended - base)      (cloze accuracy)

Beside it: the best recovery of B's attacks (``frontier.attack_point``:
every attack, refitted on the defended mechanism), the frequent-token rate
(guessing), VFLAIR-LLM's defence capability score, the split step's time
against the undefended one's, and ε where the mechanism has one. The
configuration ``aisyn split train`` runs by default, and the undefended one,
run over every seed (the spread is reported); the others over the first.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from aisyn.data.sft import SFTData
from aisyn.data.shards import TokenShards
from aisyn.eval.cloze import encoded_accuracy
from aisyn.model.families import ModelConfig, config_from_dict
from aisyn.privacy.frontier import ATTACKS_EDITION, Point, attack_point, defence_for
from aisyn.privacy.inverters import InverterSettings
from aisyn.split.client.merge import merge
from aisyn.split.client.train import split_train
from aisyn.split.defence.bottleneck import RHO_START, Bottleneck, BottleneckSpec
from aisyn.split.defence.calibration import Clips
from aisyn.split.defence.cut_dp import RECOMMENDED, CutDefence
from aisyn.split.session import COMPUTE_DIR, SplitOptions
from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.models import load_run_model
from aisyn.train.objective import evaluate_loss, sft_eval_loss
from aisyn.train.run import markdown_table, read_metrics, write_csv, write_json_atomic

log = logging.getLogger(__name__)

#: the goal at the default (issue 38): every attack at most guessing + 2
#: points, the trained inverters at most guessing + 5, both gains >= 70 %
#: kept, a step at most 1.2x the undefended one
GOAL_ATTACK = 0.02
GOAL_INVERTER = 0.05
GOAL_KEPT = 0.70
GOAL_STEP = 1.2
#: attacks that learn from more than the mechanism (the "inverter" figure)
TRAINED_INVERTERS = ("sequence inverter", "known plaintext")
#: VFLAIR-LLM's DCS weighs attack and main-task performance equally
DCS_BETA = 0.5


@dataclass(frozen=True)
class Config:
    """One way to run ``aisyn split train``, as its flags set it."""

    name: str
    backbone: str = "train"
    front_via: str = "emulator"
    emulator_blocks: int = 2
    private_warmup: int = 0
    forward: float = 0.0  # Gaussian σ on the activations (calibrated clip)
    backward: float = 0.0  # Gaussian σ on the returned gradient
    # a trained bottleneck on the activations instead (0: none)
    bottleneck_floor: float = 0.0
    bottleneck_beta: float = BottleneckSpec.beta

    @property
    def flags(self) -> str:
        """The ``aisyn split train`` flags that select it."""
        parts = []
        if self.backbone != "train":
            parts.append(f"--backbone {self.backbone}")
            if self.front_via != "emulator":
                parts.append(f"--front-via {self.front_via}")
            elif self.emulator_blocks != SplitOptions.emulator_blocks:
                parts.append(f"--emulator-blocks {self.emulator_blocks}")
        if self.private_warmup:
            parts.append(f"--private-warmup {self.private_warmup}")
        # the recommended defence (the default) noises a gradient only where
        # one crosses
        default_backward = 0.0 if self.frozen else RECOMMENDED.backward
        if self.bottleneck_floor:
            parts.append(f"--bottleneck-floor {self.bottleneck_floor:g}")
            if self.bottleneck_beta != BottleneckSpec.beta:
                parts.append(f"--bottleneck-beta {self.bottleneck_beta:g}")
            if self.backward != default_backward:
                parts.append(
                    f"--dp-backward-noise {self.backward:g} (clip calibrated on "
                    "public text)"
                )
        elif (self.forward, self.backward) == (RECOMMENDED.forward, default_backward):
            parts.append("--defence recommended")
        elif self.forward or self.backward:
            parts.append(
                f"--dp-forward-noise {self.forward:g} --dp-backward-noise "
                f"{self.backward:g} (clips calibrated on public text)"
            )
        else:
            parts.append("--defence none")
        return " ".join(parts)

    @property
    def frozen(self) -> bool:
        return self.backbone == "frozen"

    def folder(self, seed: int) -> str:
        """Its run of ``seed``'s folder name: by name, so that a ``--resume``
        finds it wherever the configuration stands in the list."""
        slug = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")
        return f"{slug}-{seed}"

    def options(self, cut: str) -> SplitOptions:
        return SplitOptions(
            cut=cut,
            mode="local",
            backbone=self.backbone,
            front_via=self.front_via,
            emulator_blocks=self.emulator_blocks,
            private_warmup=self.private_warmup,
        )

    @property
    def bottleneck(self) -> BottleneckSpec | None:
        if not self.bottleneck_floor:
            return None
        return BottleneckSpec(self.bottleneck_floor, self.bottleneck_beta)

    def defence(self, cut: str, clips: Clips) -> CutDefence:
        """What A's runs of it defend the cut with, at calibrated bounds."""
        return replace(defence_for(self.point(cut), clips), bottleneck=self.bottleneck)

    def point(self, cut: str) -> Point:
        """The frontier's point of its noise (for calibration and attacks)."""
        if self.forward or self.backward:
            return Point(
                "gaussian", cut=cut, forward=self.forward, backward=self.backward
            )
        return Point("none", cut=cut)


UNDEFENDED = Config("undefended")


def is_default(config: Config) -> bool:
    """Whether ``config`` is what ``aisyn split train`` runs with no flags:
    the trained backbone, no warm-up, the recommended noise (``--defence
    recommended``, the default when no defence flag is given)."""
    d = SplitOptions()
    return (
        config.backbone == d.backbone
        and config.private_warmup == d.private_warmup
        and not config.bottleneck_floor
        and (config.forward, config.backward)
        == (RECOMMENDED.forward, RECOMMENDED.backward)
    )


@dataclass
class Inputs:
    """What every run of one yardstick shares."""

    mcfg: ModelConfig
    base: Path  # pretrained on public text only
    data: Path  # A's private text as token shards (news): the attacked rows' home
    sft: Path  # A's supervised cloze items (news): what A fine-tunes on
    cloze: list  # A's cloze test items, encoded in the "prompt" format
    pad_id: int
    rows: torch.Tensor  # A's test rows the attacks read
    public_rows: torch.Tensor  # public rows B fits its decoders on
    cut: str
    eval_batches: int
    attack_steps: int
    inverter: InverterSettings | None = None  # B's sequence inverter
    known_rows: torch.Tensor | None = None  # A's train rows (known plaintext)
    more_public: torch.Tensor | None = None  # more public rows, inverter only


def score(model, inputs: Inputs, batch_size: int) -> dict:
    """A model's scores on A's domain: ``loss``, the LM loss of the answers
    of A's held-out supervised items (what the fine-tuning optimises);
    ``cloze``, the accuracy on A's cloze test items; ``text_loss``, the LM
    loss on A's raw test text (for reference)."""
    model.eval()
    held_out = SFTData.open(inputs.sft, "valid", verify=False)
    loss = sft_eval_loss(
        model,
        held_out,
        batch_size=batch_size,
        max_items=inputs.eval_batches * batch_size,
    )
    acc = encoded_accuracy(
        model, inputs.cloze, fmt="prompt", pad_id=inputs.pad_id, batch_size=batch_size
    )
    test = TokenShards.open(inputs.data, "test", verify=False)
    text_loss = evaluate_loss(
        model,
        test,
        batch_size=batch_size,
        max_batches=inputs.eval_batches,
        device=torch.device("cpu"),
    )
    return {
        "loss": loss,
        "cloze": acc["accuracy"],
        "chance": acc["chance"],
        "text_loss": text_loss,
    }


def step_time(run: Path) -> float:
    """The run's median split step time (s): robust to the first steps'
    warm-up and to a busy box's outliers."""
    times = [r["step_time_s"] for r in read_metrics(run / "metrics.jsonl")]
    times = [t for t in times if t is not None]
    return statistics.median(times[len(times) // 10 :] or times)


def measure(
    config: Config,
    seed: int,
    inputs: Inputs,
    clips: Clips,
    cfg: TrainConfig,
    out: Path,
) -> dict:
    """One split run of ``config``: its scores, its step time and what B's
    attacks recover from it. A run already trained and scored in ``out``
    (``scores.json``) is reused, and so are its attacks (``attacks.json``)
    if the same edition of the attacks ran them with the same settings."""
    point = config.point(inputs.cut)
    defence = config.defence(inputs.cut, clips)
    scored = out / "scores.json"
    if not scored.is_file():  # else trained and scored before (--resume)
        shutil.rmtree(out, ignore_errors=True)  # an interrupted attempt's
        run = out / "run"
        summary = split_train(
            inputs.mcfg,
            [inputs.sft],
            run,
            TrainConfig(**{**cfg.to_dict(), "seed": seed}),
            config.options(inputs.cut),
            sft=True,
            init_from=inputs.base,
            progress=False,
            defence=defence,
        )
        merge(run, run / COMPUTE_DIR, out / "merged")
        model, _ = load_run_model(out / "merged")
        privacy = summary.get("privacy", {})
        if "bottleneck" in privacy:  # what it learned, and its bound
            write_json_atomic(out / "bottleneck.json", privacy["bottleneck"])
        scores = {
            **score(model, inputs, cfg.batch_size),
            "step_time_s": step_time(run),
            "bytes_per_step": summary["bytes_sent_per_step"]
            + summary["bytes_received_per_step"],
            "dp_epsilon": privacy.get("dp_epsilon"),
        }
        write_json_atomic(scored, scores)
    scores = json.loads(scored.read_text())
    attacked = out / "attacks.json"
    key = {
        "edition": ATTACKS_EDITION,
        "steps": inputs.attack_steps,
        "rows": list(inputs.rows.shape),
        "inverter": asdict(inputs.inverter) if inputs.inverter else None,
    }
    if attacked.is_file():
        saved = json.loads(attacked.read_text())
        if saved.get("key") == key:
            return {**scores, "attacks": saved["attacks"]}
    model, _ = load_run_model(out / "merged")
    model.eval().requires_grad_(False)
    base_model, _ = load_run_model(inputs.base)
    base_model.eval().requires_grad_(False)
    # B's victims: A's weights at the first step it sends (the base's, unless
    # A warmed up privately: then B never sees those) and at the last.
    victims = {"trained (late)": model}
    if not config.private_warmup:
        victims = {"base (early)": base_model, **victims}
    attacks = attack_point(
        point,
        defence,
        victims,
        base_model,
        inputs.rows,
        inputs.public_rows,
        inputs.attack_steps,
        inverter=inputs.inverter,
        known_rows=inputs.known_rows,
        more_public=inputs.more_public,
        gradient_crosses=not config.frozen,
        bottleneck=None if config.bottleneck is None else attacked_bottleneck(out),
    )
    write_json_atomic(attacked, {"key": key, "attacks": attacks})
    return {**scores, "attacks": attacks}


def attacked_bottleneck(out: Path) -> Bottleneck:
    """The trained bottleneck of the run in ``out`` as B's attacks meet it:
    B knows the mechanism and its strength. Each coordinate's noise is the
    least A used (the start's or the trained), so neither the first steps'
    activations nor the last's are attacked through more noise than A sent."""
    config = json.loads((out / "run" / "config.json").read_text())
    spec = CutDefence.from_dict(config["cut_defence"]).bottleneck
    mcfg = config_from_dict(config["model"])
    bottleneck = Bottleneck(spec, mcfg.seq_len, mcfg.hidden_size)
    last = ckpt.latest(out / "run" / "checkpoints")
    saved = ckpt.read_tensors(last / ckpt.PRIVATE_FILE)
    prefix = "bottleneck."
    bottleneck.load_state_dict(
        {k.removeprefix(prefix): v for k, v in saved.items() if k.startswith(prefix)}
    )
    with torch.no_grad():
        bottleneck.rho.clamp_(max=RHO_START)
    return bottleneck.eval().requires_grad_(False)


def worst(attacks: list[dict], trained: bool) -> tuple[float | None, float]:
    """(best recovery, frequent-token rate there) over ``attacks``' rows:
    of the attacks that read the mechanism alone (``trained`` False) or of
    the trained inverters (True; None: none ran, or none had anything to
    read); guessing is the highest rate of any row."""
    best, guess = None, 0.0
    for a in attacks:
        guess = max(guess, a["frequent_token"])
        for k, v in a.items():
            if not k.startswith("recovery_") or v is None:
                continue
            if (k.removeprefix("recovery_") in TRAINED_INVERTERS) == trained:
                best = v if best is None else max(best, v)
    return best, guess


def kept(base: float, defended: float, undefended: float, higher_better: bool):
    """The share of the undefended gain a defended run keeps (None: no gain)."""
    gain = (undefended - base) if higher_better else (base - undefended)
    got = (defended - base) if higher_better else (base - defended)
    return got / gain if gain > 0 else None


def dcs(attack: float, main: float, ideal_main: float) -> float:
    """VFLAIR-LLM's defence capability score: 1 / (1 + the weighted distance
    from (attack, main-task) performance to the ideal defence's (0, the
    undefended main task))."""
    d = math.sqrt((1 - DCS_BETA) * attack**2 + DCS_BETA * (main - ideal_main) ** 2)
    return 1 / (1 + d)


def summarise(results: dict[str, list[dict]], configs: list[Config], base: dict):
    """Per configuration: means and spreads over its seeds of every figure
    the table shows (kept, attacks, DCS, step ratio), against the
    undefended runs of the same seeds."""
    undefended = {r["seed"]: r for r in results[UNDEFENDED.name]}
    rows = []
    for c in configs:
        runs = results.get(c.name)
        if not runs:  # not measured (yet)
            continue
        per = []
        for r in runs:
            u = undefended.get(r["seed"]) or next(iter(undefended.values()))
            attack, guess = worst(r["attacks"], trained=False)
            inverter, _ = worst(r["attacks"], trained=True)
            per.append(
                {
                    "kept_loss": kept(base["loss"], r["loss"], u["loss"], False),
                    "kept_cloze": kept(base["cloze"], r["cloze"], u["cloze"], True),
                    "attack": attack,
                    "guess": guess,
                    "inverter": inverter,
                    "step_ratio": r["step_time_s"] / u["step_time_s"],
                    "dcs": dcs(
                        max(attack or 0.0, inverter or 0.0), r["cloze"], u["cloze"]
                    ),
                    "loss": r["loss"],
                    "cloze": r["cloze"],
                }
            )
        row = {"config": c.name, "flags": c.flags, "default": is_default(c)}
        row["seeds"] = [r["seed"] for r in runs]
        for key in per[0]:
            vals = [p[key] for p in per if p[key] is not None]
            row[key] = statistics.fmean(vals) if vals else None
            row[f"{key}_spread"] = (max(vals) - min(vals)) if len(vals) > 1 else None
        row["dp_epsilon"] = runs[0]["dp_epsilon"]
        row["bytes_per_step"] = runs[0]["bytes_per_step"]
        row["meets_goal"] = meets_goal(row)
        rows.append(row)
    return rows


def meets_goal(row: dict) -> bool:
    return (
        (row["attack"] or 0.0) <= row["guess"] + GOAL_ATTACK
        and (row["inverter"] or 0.0) <= row["guess"] + GOAL_INVERTER
        and all(
            row[k] is not None and row[k] >= GOAL_KEPT
            for k in ("kept_loss", "kept_cloze")
        )
        and row["step_ratio"] <= GOAL_STEP
    )


def best_trade(rows: list[dict]) -> dict:
    """The configuration that meets the goal with the most gain kept, or, if
    none does, the one with the highest DCS (named as a trade, not a pass)."""
    passing = [r for r in rows if r["meets_goal"]]
    if passing:
        return max(passing, key=lambda r: min(r["kept_loss"], r["kept_cloze"]))
    return max(rows, key=lambda r: r["dcs"])


def pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f} %"


def summary_line(row: dict) -> str:
    """The line ``aisyn privacy audit --preset`` ends with (scripts read it);
    a share is "--" where the undefended run gained nothing to keep, and a
    rate "—" where no such attack had anything to read."""

    def kept_pct(v):
        return "--" if v is None else f"{100 * v:.0f}"

    return (
        f"default defence: attacks max {pct(row['attack'])} "
        f"(guess {pct(row['guess'])}), inverter {pct(row['inverter'])}, "
        f"gain kept {kept_pct(row['kept_loss'])} % (loss) / "
        f"{kept_pct(row['kept_cloze'])} % (cloze), step x{row['step_ratio']:.2f}"
    )


TABLE = [
    ("config", "configuration"),
    ("flags", "flags"),
    ("loss", "LM loss"),
    ("kept_loss", "kept (loss)"),
    ("cloze", "cloze acc."),
    ("kept_cloze", "kept (cloze)"),
    ("attack", "attacks max"),
    ("inverter", "inverter"),
    ("guess", "guess"),
    ("dcs", "DCS"),
    ("step_ratio", "step ×"),
    ("dp_epsilon", "ε"),
    ("meets_goal", "goal"),
]


def cell(row: dict, key: str) -> str:
    v = row.get(key)
    spread = row.get(f"{key}_spread")
    if key in ("kept_loss", "kept_cloze", "attack", "inverter", "guess", "cloze"):
        text = pct(v)
        if spread is not None and v is not None:
            text += f" ± {100 * spread / 2:.1f}"
        return text
    if v is None:
        return "∞" if key == "dp_epsilon" else "—"
    if key == "loss":
        return f"{v:.4f}" + (f" ± {spread / 2:.4f}" if spread is not None else "")
    if key == "dcs":
        return f"{v:.3f}"
    if key == "step_ratio":
        return f"{v:.2f}"
    if key == "dp_epsilon":
        return f"{v:.3g}"
    if key == "meets_goal":
        return "✔" if v else "✘"
    if key == "config" and row.get("default"):
        return f"**{v}** (default)"
    return f"`{v}`" if key == "flags" else str(v)


def table(rows: list[dict]) -> str:
    return "\n".join(
        markdown_table(
            [h for _, h in TABLE], [[cell(r, k) for k, _ in TABLE] for r in rows]
        )
    )


def figure(rows: list[dict]):
    """Gain kept against what the strongest attack recovers: per
    configuration (labelled with its name, a colour each) a circle for the
    loss and a triangle for the cloze accuracy; guessing and the goal drawn
    in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), layout="constrained")
    guess = max(r["guess"] for r in rows)
    ax.axvspan(0, 100 * (guess + GOAL_ATTACK), alpha=0.08, color="green")
    ax.axhline(100 * GOAL_KEPT, color="green", linestyle=":", label="goal: kept")
    ax.axvline(100 * guess, color="grey", linestyle=":", label="guessing")
    for i, r in enumerate(rows):
        colour = plt.cm.tab10(i % 10)
        x = 100 * max(r["attack"] or 0.0, r["inverter"] or 0.0)
        for key, marker in (("kept_loss", "o"), ("kept_cloze", "^")):
            if r[key] is not None:
                ax.scatter(
                    x,
                    100 * r[key],
                    color=colour,
                    marker=marker,
                    label=r["config"] if key == "kept_loss" else f"_{r['config']}",
                )
    ax.set_xlabel("tokens recovered by B's strongest attack (%)")
    ax.set_ylabel("undefended gain kept (%)  o: LM loss, ^: cloze accuracy")
    ax.set_xlim(0, 100)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title("what each configuration keeps, and what B still reads")
    return fig


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib.pyplot as plt

    fig = figure(rows)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path, report: dict) -> None:
    rows = report["rows"]
    choice = report["choice"]
    verdict = (
        f"**{choice['config']}** (`{choice['flags']}`) meets the goal."
        if choice["meets_goal"]
        else f"No configuration meets the goal; the best trade (highest DCS) is "
        f"**{choice['config']}** (`{choice['flags']}`)."
    )
    b = report["base"]
    (out / "frontier.md").write_text(
        f"# What each configuration keeps (preset {report['preset']})\n\n"
        f"Split fine-tuning of a base pretrained on public text only, on A's "
        f"private text, {report['train']['steps']} steps per run; the base "
        f"scores LM loss {b['loss']:.4f} and cloze accuracy {pct(b['cloze'])} "
        f"(chance {pct(b['chance'])}) on A's domain. Kept: the share of the "
        f"undefended run's gain; ± half the spread over seeds "
        f"{report['seeds']} (default and undefended). Attacks max: every attack "
        f"that reads the mechanism, refitted on it; inverter: the trained "
        f"inverters ({', '.join(TRAINED_INVERTERS)}); guess: the frequent-token "
        f"rate. Goal: attacks ≤ guess + {100 * GOAL_ATTACK:.0f}, inverter ≤ "
        f"guess + {100 * GOAL_INVERTER:.0f}, kept ≥ {100 * GOAL_KEPT:.0f} % on "
        f"both, step ≤ {GOAL_STEP}×.\n\n{table(rows)}\n\n{verdict}\n",
        encoding="utf-8",
    )
    (out / "frontier.json").write_text(json.dumps(report, indent=2, default=str))
    write_csv(out / "frontier.csv", rows)
    plot(out / "frontier.png", rows)

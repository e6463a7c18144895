"""The privacy frontier: each defence on the cut, at several strengths, by
what it lets the compute party recover and what it costs.

For every point (a defence and its strength) this trains a real split run
(in-process, the defence on A's side) from the public base on A's text for
the same number of steps, merges its halves and measures the test loss of
the merged model (run whole, in the clear) and of the split run served with
its defence still on. Then it attacks what that defence lets cross, with the
base's weights (B's best knowledge at the start) and with the run's own
(late in training, what a B that knew A's weights exactly would have). The
attacks are ``attacks.py``'s, made *adaptive*: B is assumed to know the
mechanism and its strength (not the noise it draws), so its learned decoders
(a linear one, an MLP over five positions, a transformer over the sequence
and similarity to per-token references, ``inverters.py``) are fitted on
public text sent through the same mechanism; the known-plaintext bound also
holds some of A's own pairs. Per point: both losses and their cost against no
defence, ε (``split.cut_dp``, from the run's own accounting), bytes on the link
per step, and the best recovery of each direction beside the frequent-token
rate.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch

from aisyn.data.shards import TokenShards
from aisyn.model.causal_lm import CausalLM
from aisyn.model.families import ModelConfig
from aisyn.model.segments import parse_partition
from aisyn.privacy.attacks import (
    frequent_token_rate,
    infer_labels,
    invert_activations,
    recovery,
)
from aisyn.privacy.audit import (
    NOTHING_CROSSED,
    Crossing,
    crossing,
    decoded,
    known_plaintext_decoder,
    learned_decoders,
    public_crossing,
)
from aisyn.privacy.inverters import InverterSettings
from aisyn.split import cut_dp as dp
from aisyn.split.calibration import Clips, blocks_of, calibrate
from aisyn.split.evaluate import open_split_model
from aisyn.split.merge import merge
from aisyn.split.session import COMPUTE_DIR, SplitOptions
from aisyn.split.train import split_train
from aisyn.train.config import TrainConfig
from aisyn.train.models import load_run_model
from aisyn.train.objective import evaluate_loss

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Point:
    """One defence at one strength. ``forward`` / ``backward``: the Gaussian
    noise multipliers on the activations A sends and on the gradient it
    returns (0: that direction crosses in the clear; clipping bounds are
    calibrated on public text); ``embedding_eps``: EmbeddingDP's ε per bit;
    ``cut``: where A cuts (more blocks on A is a defence too, alone or with
    noise)."""

    family: str  # none | gaussian | embedding-dp | blocks
    cut: str = "u:1,1"
    forward: float = 0.0
    backward: float = 0.0
    embedding_eps: float | None = None

    @property
    def label(self) -> str:
        where = "" if self.cut == "u:1,1" else f", cut {self.cut}"
        if self.family == "gaussian":
            if self.forward == self.backward:
                return f"Gaussian σ={self.forward:g} both ways{where}"
            sides = [
                f"σ={sigma:g} on the {name}"
                for name, sigma in (
                    ("activations", self.forward),
                    ("gradient", self.backward),
                )
                if sigma
            ]
            return "Gaussian " + ", ".join(sides) + where
        if self.family == "embedding-dp":
            return f"EmbeddingDP ε={self.embedding_eps:g}/bit{where}"
        if self.family == "blocks":
            return f"cut {self.cut}"
        return "none"


def defence_for(point: Point, clips: Clips) -> dp.CutDefence:
    if point.family == "gaussian":
        return dp.CutDefence(
            forward=dp.Gaussian(clips.forward, point.forward)
            if point.forward
            else None,
            backward=dp.Gaussian(clips.backward, point.backward)
            if point.backward
            else None,
        )
    if point.family == "embedding-dp":
        return dp.CutDefence(embedding_dp=point.embedding_eps)
    return dp.CutDefence()


def train_point(
    point: Point,
    defence: dp.CutDefence,
    mcfg: ModelConfig,
    base: Path,
    data: Path,
    out: Path,
    cfg: TrainConfig,
    eval_batches: int,
) -> dict:
    """Train the point's split run, merge it and score the merged model on
    the test split: what the defence costs."""
    run = out / "run"
    summary = split_train(
        mcfg,
        [data],
        run,
        cfg,
        SplitOptions(cut=point.cut, mode="local"),
        init_from=base,
        progress=False,
        defence=defence,
    )
    merge(run, run / COMPUTE_DIR, out / "merged")
    model, config = load_run_model(out / "merged")
    test = TokenShards.open(
        data, "test", tokenizer_sha256=config["tokenizer"]["sha256"]
    )
    score = partial(
        evaluate_loss,
        shards=test,
        batch_size=cfg.batch_size,
        max_batches=eval_batches,
        device=torch.device("cpu"),
    )
    # Served split, the activations still pass the defence (fresh noise);
    # merged, the model runs whole and in the clear.
    with open_split_model(run) as served:
        served_loss = score(served)
    privacy = summary.get("privacy", {})
    return {
        "test_loss": score(model),
        "served_split_loss": served_loss,
        "dp_epsilon": privacy.get("dp_epsilon"),
        "bytes_per_step": summary["bytes_sent_per_step"]
        + summary["bytes_received_per_step"],
        "model": model,
    }


def protected(c: Crossing, defence: dp.CutDefence) -> Crossing:
    """What B receives of ``c`` under ``defence`` (noise B does not know);
    a direction in which nothing crossed stays None."""
    if not defence.active:
        return c
    guard = dp.CutGuard(defence, secrets.randbits(63))
    return Crossing(
        c.inputs,
        c.labels,
        None if c.acts is None else guard.activations(c.acts, "audit"),
        c.out,
        None if c.grad is None else guard.gradient(c.grad, "audit"),
    )


def attack_point(
    point: Point,
    defence: dp.CutDefence,
    victims: dict[str, CausalLM],
    base_model: CausalLM,
    rows: torch.Tensor,
    public: torch.Tensor,
    steps: int,
    *,
    inverter: InverterSettings | None = None,
    known_rows: torch.Tensor | None = None,
    more_public: torch.Tensor | None = None,
    gradient_crosses: bool = True,
) -> list[dict]:
    """Best recovery per direction, for each of A's weights in ``victims``,
    by a B that knows the base's weights and the mechanism. ``inverter``:
    the sequence inverter's size and steps; ``known_rows``: rows of A's
    train split (never ``rows``) whose pairs, from each victim through the
    same mechanism, the known-plaintext bound is fine-tuned on (None: no
    such bound); ``more_public``: further public rows for the inverter and
    the similarity references only. A direction in which nothing crossed
    reports recovery None, by "nothing crossed": with ``gradient_crosses``
    False (``split train --backbone frozen``), the backward one."""
    partition = parse_partition(point.cut, base_model.config)
    first, _, back = blocks_of(partition)
    # B's decoders, fitted on public text sent through the same mechanism, in
    # steps of as many rows as the attacked step (the gradient's scale, which
    # clipping and noise act on, is 1 / the tokens of a step).
    step = len(rows)

    def sent(c: Crossing) -> Crossing:
        """What B receives of ``c``: through the mechanism, and no gradient
        at all where none crosses."""
        c = protected(c, defence)
        return c if gradient_crosses else replace(c, grad=None)

    pub = sent(public_crossing(base_model, public, partition, step))
    more = (
        None
        if more_public is None
        else sent(public_crossing(base_model, more_public, partition, step))
    )
    learned = learned_decoders(
        pub, base_model.config.vocab_size, inverter, more_public=more
    )
    out = []
    for weights, victim in victims.items():
        seen = sent(crossing(victim, rows, partition))
        own = (
            None
            if known_rows is None
            else sent(public_crossing(victim, known_rows, partition, step))
        )
        known = known_plaintext_decoder(learned, own, inverter)
        got = {
            ("white-box", "forward"): None
            if seen.acts is None
            else invert_activations(base_model, seen.acts, first, steps=steps),
            ("white-box", "backward"): None
            if seen.grad is None
            else infer_labels(base_model, seen.out, seen.grad, back, steps=steps),
            **decoded({**learned, **known}, seen),
        }
        for direction, truth in (("forward", seen.inputs), ("backward", seen.labels)):
            rates = {
                a: None if g is None else recovery(g, truth)
                for (a, d), g in got.items()
                if d == direction
            }
            measured = {a: r for a, r in rates.items() if r is not None}
            best = max(measured, key=measured.get) if measured else NOTHING_CROSSED
            out.append(
                {
                    "A_weights": weights,
                    "direction": direction,
                    "recovery": measured.get(best),
                    "best_attack": best,
                    **{f"recovery_{a}": r for a, r in rates.items()},
                    "frequent_token": frequent_token_rate(truth),
                }
            )
    return out


def frontier(
    points: list[Point],
    *,
    base: Path,
    data: Path,
    public_rows: torch.Tensor,
    rows: torch.Tensor,
    out: Path,
    cfg: TrainConfig,
    eval_batches: int,
    attack_steps: int,
    inverter: InverterSettings | None = None,
    known_rows: torch.Tensor | None = None,
    more_public: torch.Tensor | None = None,
) -> list[dict]:
    """Every point: its cost (a real split run) and what B recovers
    (``attack_point``'s ``inverter``, ``known_rows`` and ``more_public``)."""
    base_model, _ = load_run_model(base)
    base_model.eval().requires_grad_(False)
    clips: dict[str, Clips] = {}
    results: list[dict] = []
    reference: tuple[float, float] | None = None
    for n, point in enumerate(points):
        if point.cut not in clips:
            clips[point.cut] = calibrate(
                base_model, public_rows, point.cut, cfg.batch_size
            )
        defence = defence_for(point, clips[point.cut])
        log.info("frontier point %d/%d: %s", n + 1, len(points), point.label)
        cost = train_point(
            point,
            defence,
            base_model.config,
            base,
            data,
            out / f"point-{n:02d}",
            cfg,
            eval_batches,
        )
        trained = cost.pop("model").eval().requires_grad_(False)
        if point.family == "none":
            reference = cost["test_loss"], cost["served_split_loss"]
        attacked = attack_point(
            point,
            defence,
            {"base (early)": base_model, "trained (late)": trained},
            base_model,
            rows,
            public_rows,
            attack_steps,
            inverter=inverter,
            known_rows=known_rows,
            more_public=more_public,
        )
        for a in attacked:
            results.append(
                {
                    "defence": point.label,
                    **asdict(point),
                    "clip_forward": clips[point.cut].forward,
                    "clip_backward": clips[point.cut].backward,
                    **cost,
                    "loss_cost": None
                    if reference is None
                    else cost["test_loss"] - reference[0],
                    "served_split_cost": None
                    if reference is None
                    else cost["served_split_loss"] - reference[1],
                    **a,
                }
            )
            log.info("%s", results[-1])
    return results


def recommended(results: list[dict], *, max_recovery: float, max_cost: float):
    """The weakest defence (least loss cost) whose best attack, early and
    late, forward and backward, recovers at most ``max_recovery`` (or the
    frequent-token rate, where that is higher: no defence can take away what
    guessing gets) at a loss cost of at most ``max_cost``; None if none does."""
    by_point: dict[str, list[dict]] = {}
    for r in results:
        by_point.setdefault(r["defence"], []).append(r)
    ok = []
    for label, rs in by_point.items():
        cost = rs[0]["loss_cost"]
        if cost is None or cost > max_cost:
            continue
        # None: nothing crossed in that direction, so nothing is recovered
        if all(
            (r["recovery"] or 0.0) <= max(max_recovery, r["frequent_token"]) for r in rs
        ):
            ok.append((cost, label))
    return min(ok)[1] if ok else None

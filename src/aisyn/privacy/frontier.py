"""A defence on the cut and what B's attacks recover through it.

``Point``: a Gaussian defence at its strengths (or none) at a cut, and the
``CutDefence`` it makes once its clipping bounds are calibrated;
``attack_point``: every attack of the audit (``attacks.py``, ``inverters.py``)
made *adaptive* -- B knows the mechanism and its strength, not the noise it
draws or A's private weights, so its learned decoders are fitted on public
text sent through the same mechanism -- on what each of A's weights sends,
with the best recovery per direction beside the frequent-token rate. The
yardstick (``yardstick.py``) runs it on every configuration it measures.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from dataclasses import dataclass, replace

import torch

from aisyn.model.causal_lm import CausalLM
from aisyn.model.segments import parse_partition
from aisyn.privacy.attacks import (
    base_head_labels,
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
from aisyn.split.defence import cut_dp as dp
from aisyn.split.defence.bottleneck import Bottleneck
from aisyn.split.defence.calibration import Clips, blocks_of

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


def mechanism(defence: dp.CutDefence, bottleneck: Bottleneck | None = None):
    """(forward, backward): the functions that turn what A would send into
    what B receives under ``defence`` (with its trained ``bottleneck``, if it
    has one), with noise B does not know (a fresh secret, and fresh draws at
    every call); None for a direction that crosses in the clear."""
    if not defence.active:
        return None, None
    guard = dp.CutGuard(defence, secrets.randbits(63), bottleneck)
    draws = itertools.count()
    forward = (
        defence.forward is not None
        or defence.embedding_dp is not None
        or defence.bottleneck is not None
    )
    return (
        (lambda h: guard.activations(h, "audit", next(draws))) if forward else None,
        (lambda g: guard.gradient(g, "audit", next(draws)))
        if defence.backward is not None
        else None,
    )


#: The attacks' edition: bump it whenever an attack changes what it can
#: recover (a new attack, a stronger fit), so that results saved by an older
#: edition (the yardstick's ``attacks.json``) are not reused on --resume.
# 2: the base head's label attack on B's own output; 3: B's output and the
# gradient of what crossed (forward noise), not of A's clean activations
ATTACKS_EDITION = 3


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
    bottleneck: Bottleneck | None = None,
) -> list[dict]:
    """Best recovery per direction, for each of A's weights in ``victims``,
    by a B that knows the base's weights and the mechanism. ``inverter``:
    the sequence inverter's size and steps; ``known_rows``: rows of A's
    train split (never ``rows``) whose pairs, from each victim through the
    same mechanism, the known-plaintext bound is fine-tuned on (None: no
    such bound); ``more_public``: further public rows for the inverter and
    the similarity references only. A direction in which nothing crossed
    reports recovery None, by "nothing crossed": with ``gradient_crosses``
    False (``split train --backbone frozen``), every backward attack but the
    base head's, which reads only B's own output. ``bottleneck``: the run's
    trained bottleneck, which ``defence`` names."""
    partition = parse_partition(point.cut, base_model.config)
    first, _, back = blocks_of(partition)
    # B's decoders, fitted on public text sent through the same mechanism, in
    # steps of as many rows as the attacked step (the gradient's scale, which
    # clipping and noise act on, is 1 / the tokens of a step).
    step = len(rows)

    forward, backward = mechanism(defence, bottleneck)

    def sent(c: Crossing) -> Crossing:
        """What B receives of ``c`` (its activations already through the
        forward mechanism): the gradient through the backward one, or none
        at all where none crosses."""
        if not gradient_crosses:
            return replace(c, grad=None)
        return c if backward is None else replace(c, grad=backward(c.grad))

    def public_sent(model: CausalLM, rows: torch.Tensor) -> Crossing:
        return sent(public_crossing(model, rows, partition, step, forward))

    pub = public_sent(base_model, public)
    more = None if more_public is None else public_sent(base_model, more_public)
    learned = learned_decoders(
        pub, base_model.config.vocab_size, inverter, more_public=more
    )
    out = []
    for weights, victim in victims.items():
        seen = sent(crossing(victim, rows, partition, forward))
        own = None if known_rows is None else public_sent(victim, known_rows)
        known = known_plaintext_decoder(learned, own, inverter)
        got = {
            ("white-box", "forward"): None
            if seen.acts is None
            else invert_activations(base_model, seen.acts, first, steps=steps),
            ("white-box", "backward"): None
            if seen.grad is None
            else infer_labels(base_model, seen.out, seen.grad, back, steps=steps),
            # B's own output, which it always has, through the base's back
            # blocks and head: the next token as B's best model of A would
            # predict it. No gradient needed: with none crossing, this is
            # what B still knows of the labels (in LM fine-tuning the labels
            # are the next inputs).
            ("base head", "backward"): None
            if seen.out is None
            else base_head_labels(base_model, seen.out, back),
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

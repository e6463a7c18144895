"""Bounds on each centre's DiLoCo delta before it moves the global model.

A centre with valid credentials can send a finite delta that is not the
outcome of honest training -- scaled by 10^6, sign-flipped, or the product of
a centre that diverged. Averaged in, it moves every centre's global model by
its 1/N share; a x10^6 one wrecks the model, and the checkpoint after it would
keep the wreck. So before the exchange every centre reports, and every
centre sees, each centre's delta norm and its cosine to the run's recent
direction (the outer momentum, or the last applied mean delta); every centre
then applies the same verdicts (the rules are deterministic on the same
numbers), and an out-of-bound centre's delta is left out of the mean, by name.

A centre is out of bound when

* its delta is not finite;
* its norm is above ``bound`` x the median of the other centres' norms --
  of those others whose own norm has not fallen below 1/``bound`` of their
  last accepted one (a centre that sends nearly nothing must not make an
  honest one look huge: with two centres "the others" is one centre, which
  may be the liar); where no such other is left (one centre left, or a
  single other that fell), above ``bound`` x its own last accepted norm.
  Peers come first because a centre's own norm moves with the learning
  rate (warm-up, decay) as every centre's does; a run of one centre is not
  bounded (there is no one to lie to);
* its cosine to the run's recent direction is below ``min_cosine`` (a
  sign-flipped delta: honest centres' deltas point along the momentum).

Reported numbers are checked against what arrives (``consistent``), so a
centre cannot report a small norm and send a large delta.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

#: accepted norms kept per centre (the newest bounds it; the rest are a
#: record, in checkpoints, of how its norms went)
HISTORY = 5


@dataclass(frozen=True)
class Verdict:
    """One outer step's screening: per centre, None (accepted) or why not."""

    reasons: list[str | None]
    norms: list[float]
    dots: list[float]
    cosines: list[float]
    ref_norm: float

    @property
    def accepted(self) -> list[int]:
        return [c for c, r in enumerate(self.reasons) if r is None]

    @property
    def refused(self) -> list[int]:
        return [c for c, r in enumerate(self.reasons) if r is not None]


class DeltaGuard:
    """The verdicts on the centres' reported delta statistics, and the
    per-centre history of accepted norms they use (identical on every centre:
    it is built from the same gathered numbers, saved in checkpoints and sent
    to a joining centre)."""

    def __init__(self, centres: int, bound: float, min_cosine: float) -> None:
        self.centres = centres
        self.bound = bound
        self.min_cosine = min_cosine
        # 0: no norm yet (a checkpoint holds no NaN); the newest last
        self.history = torch.zeros((centres, HISTORY), dtype=torch.float64)
        self.refused_in_row = [0] * centres

    # --- verdicts ------------------------------------------------------------

    def judge(self, stats: torch.Tensor) -> Verdict:
        """``stats``: one row per centre, (squared norm, dot with the
        reference direction, squared norm of the reference)."""
        sq, dot, ref_sq = (stats[:, i].double() for i in range(3))
        norms = sq.sqrt().tolist()
        ref_norm = float(ref_sq[0].sqrt())
        cosines = [
            float(d) / (n * ref_norm) if n > 0 and ref_norm > 0 else math.nan
            for d, n in zip(dot.tolist(), norms, strict=True)
        ]
        reasons = [self._reason(c, norms, cosines[c]) for c in range(self.centres)]
        return Verdict(reasons, norms, dot.tolist(), cosines, ref_norm)

    def _reason(self, c: int, norms: list[float], cosine: float) -> str | None:
        n = norms[c]
        if not math.isfinite(n):
            return "its delta is not finite"
        if self.centres == 1:
            return None  # the whole run: no one to bound it against
        others = [
            x
            for i, x in enumerate(norms)
            if i != c and math.isfinite(x) and x > 0 and not self._fell(i, x)
        ]
        last = self.last_norm(c)
        ref = what = None
        if others:
            ref, what = statistics.median(others), "the other centres' median"
        elif last is not None:
            ref, what = last, "its own last accepted one"
        if ref is not None and n > self.bound * ref:
            return (
                f"its delta's norm {n:.4g} is {n / ref:.3g}x {what} ({ref:.4g}), "
                f"above --delta-bound {self.bound:g}"
            )
        if math.isfinite(cosine) and cosine < self.min_cosine:
            return (
                f"its delta points against the run's recent direction (cosine "
                f"{cosine:.3f}, below --delta-min-cosine {self.min_cosine:g})"
            )
        return None

    def last_norm(self, c: int) -> float | None:
        """Centre ``c``'s last accepted delta norm (None: none yet)."""
        newest = float(self.history[c, -1])
        return newest if newest > 0 else None

    def _fell(self, c: int, norm: float) -> bool:
        """Whether centre ``c``'s norm fell below 1/bound of its last one."""
        last = self.last_norm(c)
        return last is not None and norm < last / self.bound

    def record(self, verdict: Verdict, liars: list[int] = ()) -> None:
        """Keep the accepted centres' norms; count each centre's refusals in a
        row (a centre caught misreporting counts as refused)."""
        for c in range(self.centres):
            if verdict.reasons[c] is None and c not in liars:
                self.refused_in_row[c] = 0
                if not verdict.norms[c] > 0:
                    continue  # a zero delta bounds nothing
                row = self.history[c]
                self.history[c] = torch.cat(
                    [row[1:], row.new_tensor([verdict.norms[c]])]
                )
            else:
                self.refused_in_row[c] += 1

    # --- checkpoints ---------------------------------------------------------

    def state(self) -> torch.Tensor:
        return self.history.clone()

    def load(self, history: torch.Tensor | None) -> None:
        """A saved history (None: none saved); a run resumed by fewer or more
        centres keeps the rows of the centres it still has (those after a lost
        one move down: docs/cross_centre.md), the others start empty."""
        self.history.zero_()
        if history is None:
            return
        if history.dim() != 2 or history.shape[1] != HISTORY:
            raise ValueError(f"a delta history of shape {tuple(history.shape)}")
        if not bool(torch.isfinite(history).all()) or bool((history < 0).any()):
            raise ValueError("a delta history with negative or non-finite norms")
        rows = min(self.centres, history.shape[0])
        self.history[:rows] = history[:rows].double()


def screen_stats(delta: torch.Tensor, reference: torch.Tensor | None) -> torch.Tensor:
    """This rank's part of (squared norm, dot with ``reference``, squared
    norm of ``reference``) of ``delta``, in float64 (summed over a centre's
    shards by the caller)."""
    d = delta.double()
    if reference is None:
        return torch.stack([d.square().sum(), d.new_zeros(()), d.new_zeros(())])
    r = reference.double()
    return torch.stack([d.square().sum(), torch.dot(d, r), r.square().sum()])


#: how far a received delta's statistics may stray from the reported ones,
#: relative to its norm: the precision's own rounding (int8's error in a
#: block is at most 64/254 of its largest value's share of the block's norm)
TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2, "fp16": 2e-2, "int8": 0.3}


def consistent(
    got: tuple[float, float], said: tuple[float, float], ref_norm: float, tol: float
) -> bool:
    """Whether a delta's (norm, dot with the reference) as received match
    what was reported, within ``tol`` of the reported norm (and of it times
    the reference's norm for the dot)."""
    (n_got, dot_got), (n_said, dot_said) = got, said
    if not (math.isfinite(n_got) and math.isfinite(dot_got)):
        return False
    slack = tol * n_said + 1e-12
    return n_got <= n_said + slack and abs(dot_got - dot_said) <= slack * (
        ref_norm + 1e-12
    )

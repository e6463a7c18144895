"""Defences on the cut: what the data party adds to the tensors it sends, and
the privacy budget that buys.

Two directions leave A in split training: the activations of the front cut
(a function of A's input tokens) and the gradient of the loss for B's output
(a function of A's labels, i.e. the next tokens). Each can pass a
*Gaussian mechanism* here: every row (one sequence of the batch) is clipped to
an L2 norm ``clip`` and noise N(0, (noise · clip)²) is added to every element.
The reference's *EmbeddingDP* is here too as a comparison point: 1-bit
quantisation of the activations (> 0) and randomized response on every bit.

The budget is accounted by Google's ``dp-accounting`` (RDP, ``aisyn.accountant``):

* the unit of privacy is one row of A's data (a token window, or one SFT
  example); neighbouring datasets differ by *replacing* one row, so a clipped
  row moves by at most ``2 · clip`` and each release is a Gaussian mechanism
  of noise multiplier ``noise / 2``;
* a row is sent once per epoch it is drawn in, forward and backward: ``k``
  epochs compose ``2k`` Gaussian mechanisms. No amplification by sampling is
  claimed (the batch order is a shuffle, not Poisson sampling), so ε is an
  upper bound;
* what ε covers: the tensors that cross the cut, each given A's parameters of
  that step. A's own parameters are trained on the same rows and shape later
  activations; for an end-to-end guarantee they would have to be trained
  privately too (not done here; docs/privacy.md says so).

The noise is drawn from generators seeded by a secret of A's (never sent) and
the round's coordinates, so a resumed run draws exactly the noise it would
have, with no generator state in checkpoints.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

import torch

from aisyn import accountant
from aisyn.accountant import DEFAULT_DELTA
from aisyn.split.defence.bottleneck import Bottleneck, BottleneckSpec
from aisyn.validate import check_number


@dataclass(frozen=True)
class NoiseMultipliers:
    """The noise multiplier σ of each direction (0: that one crosses clear)."""

    forward: float  # on the activations A sends
    backward: float  # on the gradient A returns


#: The recommended defence, measured by ``aisyn privacy audit --preset full``
#: (docs/privacy.md): every attack at 8.3 % or less, below the frequent-token
#: rate, for 0.056 nats after 300 steps. The one home of these numbers:
#: ``privacy calibrate`` prints them and ``split train --defence recommended``
#: runs them.
RECOMMENDED = NoiseMultipliers(forward=0.1, backward=0.3)

#: What an undefended run gives away, in the same measurement (the default cut
#: u:1,1, a compute party that knows the base): the best attack's share of A's
#: input tokens, and of its labels, recovered.
UNDEFENDED_INPUTS_RECOVERED = 0.68
UNDEFENDED_LABELS_RECOVERED = 0.96


@dataclass(frozen=True)
class Gaussian:
    """Per-row clipping to L2 norm ``clip``, then noise of std ``noise · clip``."""

    clip: float
    noise: float = 0.0

    def __post_init__(self) -> None:
        check_number("clip", self.clip, low=0, low_open=True)
        check_number("noise", self.noise, low=0)


@dataclass(frozen=True)
class CutDefence:
    """What A does to the tensors it sends B (A's own setting; B is not told)."""

    forward: Gaussian | None = None  # on the activations of the front cut
    backward: Gaussian | None = None  # on the gradient A returns for B's output
    embedding_dp: float | None = None  # EmbeddingDP's ε per coordinate (forward)
    delta: float = DEFAULT_DELTA
    # a trained bottleneck on the activations (``split.defence.bottleneck``)
    bottleneck: BottleneckSpec | None = None

    def __post_init__(self) -> None:
        check_number("delta", self.delta, low=0, high=1, low_open=True, high_open=True)
        if self.embedding_dp is not None:
            check_number(
                "embedding-dp epsilon", self.embedding_dp, low=0, low_open=True
            )
        forwards = [
            name
            for name, on in (
                ("a Gaussian forward defence (--dp-forward-*)", self.forward),
                ("EmbeddingDP (--embedding-dp)", self.embedding_dp is not None),
                ("a trained bottleneck (--bottleneck-*)", self.bottleneck),
            )
            if on
        ]
        if len(forwards) > 1:
            raise ValueError(
                f"{' and '.join(forwards)} each replace the activations A sends: "
                "choose one"
            )

    @property
    def active(self) -> bool:
        return bool(
            self.forward
            or self.backward
            or self.embedding_dp is not None
            or self.bottleneck
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> CutDefence:
        d = dict(d or {})
        for side in ("forward", "backward"):
            if d.get(side) is not None:
                d[side] = Gaussian(**d[side])
        if d.get("bottleneck") is not None:
            d["bottleneck"] = BottleneckSpec(**d["bottleneck"])
        return cls(**d)

    def describe(self) -> str:
        parts = []
        for side in ("forward", "backward"):
            g = getattr(self, side)
            if g is not None:
                parts.append(f"{side}: clip {g.clip:g}, noise {g.noise:g}")
        if self.embedding_dp is not None:
            parts.append(f"forward: EmbeddingDP ε {self.embedding_dp:g} per bit")
        if self.bottleneck is not None:
            b = self.bottleneck
            parts.append(
                f"forward: trained bottleneck, floor {b.floor:g}, β {b.beta:g}"
            )
        return "; ".join(parts) or "none"


@dataclass(frozen=True)
class Recommended:
    """A request for ``RECOMMENDED`` noise with bounds calibrated at the run's
    start (``split train --defence recommended``, and what ``split train``
    runs when no defence flag is given); the run turns it into a
    ``CutDefence`` (``recommended_defence``) once it knows its model.

    ``gradient``: a gradient crosses the cut (not so under ``--backbone
    frozen``: then the noise is on the activations alone). ``implied``: no
    defence flag asked for it (the default): a resumed run then keeps
    whatever defence it started with instead of refusing another."""

    delta: float = DEFAULT_DELTA
    gradient: bool = True
    implied: bool = False
    #: a trained bottleneck in place of the forward noise (``--bottleneck-*``)
    bottleneck: BottleneckSpec | None = None

    #: noise on what crosses, whatever the bounds come to
    active = True

    def __post_init__(self) -> None:
        check_number("delta", self.delta, low=0, high=1, low_open=True, high_open=True)

    def matches(self, defence: CutDefence) -> bool:
        """``defence`` is this request's, whatever its calibrated bounds."""
        backward_ok = (
            defence.backward is not None
            and defence.backward.noise == RECOMMENDED.backward
            if self.gradient
            else defence.backward is None
        )
        forward_ok = (
            defence.forward is None and defence.bottleneck == self.bottleneck
            if self.bottleneck is not None
            else defence.forward is not None
            and defence.forward.noise == RECOMMENDED.forward
            and defence.bottleneck is None
        )
        return (
            defence.embedding_dp is None
            and defence.delta == self.delta
            and forward_ok
            and backward_ok
        )


def recommended_defence(
    forward_clip: float,
    backward_clip: float | None,
    delta: float = DEFAULT_DELTA,
    bottleneck: BottleneckSpec | None = None,
) -> CutDefence:
    """``RECOMMENDED`` noise at these clipping bounds: on both directions, or
    on the activations alone where no gradient crosses (``backward_clip``
    None); a ``bottleneck`` takes the forward noise's place."""
    return CutDefence(
        forward=None
        if bottleneck is not None
        else Gaussian(forward_clip, RECOMMENDED.forward),
        backward=None
        if backward_clip is None
        else Gaussian(backward_clip, RECOMMENDED.backward),
        delta=delta,
        bottleneck=bottleneck,
    )


def undefended_warning(frozen_backbone: bool = False) -> str:
    """The one line an undefended split run (``--defence none``) starts with
    (``frozen_backbone``: no gradient crosses, so only the activations'
    channel is open)."""
    if frozen_backbone:
        return (
            "--defence none: no cut defence on the activations: in "
            "docs/privacy.md's audit a compute party that knows the base "
            f"recovers {UNDEFENDED_INPUTS_RECOVERED:.0%} of the input tokens from "
            "them (--private-warmup moves A's front away from the base first); no "
            "gradient crosses (--backbone frozen), but B's own output read through "
            "the public head still predicts the labels; leave --defence out for "
            f"the default (σ {RECOMMENDED.forward:g} on the activations)"
        )
    return (
        "--defence none: no cut defence: in docs/privacy.md's audit a compute "
        "party that knows the base recovers "
        f"{UNDEFENDED_INPUTS_RECOVERED:.0%} of the input tokens and "
        f"{UNDEFENDED_LABELS_RECOVERED:.0%} of the labels from what crosses; "
        "leave --defence out for the default, which takes both to the guessing "
        f"rate (σ {RECOMMENDED.forward:g} on the activations, "
        f"{RECOMMENDED.backward:g} on the gradient, clipping bounds calibrated on "
        "public text)"
    )


#: ``split train --defence``: a named defence instead of the ``--dp-*`` flags
DEFENCES = ("none", "recommended")


def defence_from_flags(
    *,
    forward_clip: float | None = None,
    forward_noise: float | None = None,
    backward_clip: float | None = None,
    backward_noise: float | None = None,
    delta: float | None = None,
    embedding_dp: float | None = None,
    named: str | None = None,
    bottleneck_floor: float | None = None,
    bottleneck_beta: float | None = None,
) -> CutDefence | Recommended:
    """The defence ``aisyn split train``'s ``--defence`` (``named``), ``--dp-*``
    and ``--embedding-dp`` flags ask for, or a one-line ``ValueError`` naming
    the flag that makes no sense (noise without a clipping bound, a delta with
    no Gaussian noise, a named defence with flags that would change it: only
    ``--dp-delta`` goes with ``--defence recommended``, as it changes what ε
    is reported at, not the run). No defence flag (``--dp-delta`` aside)
    asks for the recommended defence: the safe choice is the default, and
    ``--defence none`` is how to run undefended. ``--bottleneck-floor`` (and
    ``-beta``) put a trained bottleneck (``split.defence.bottleneck``) in place of
    the forward noise, of the recommended defence or beside ``--dp-backward-*``."""
    if bottleneck_beta is not None and bottleneck_floor is None:
        raise ValueError(
            "--bottleneck-beta needs --bottleneck-floor (the least noise of the "
            "bottleneck, which it turns on)"
        )
    spec = (
        None
        if bottleneck_floor is None
        else BottleneckSpec(
            bottleneck_floor,
            *(() if bottleneck_beta is None else (bottleneck_beta,)),
        )
    )
    given = {
        "--dp-forward-clip": forward_clip,
        "--dp-forward-noise": forward_noise,
        "--dp-backward-clip": backward_clip,
        "--dp-backward-noise": backward_noise,
        "--embedding-dp": embedding_dp,
        "--dp-delta": delta,
    }
    if named is not None:
        if named not in DEFENCES:
            raise ValueError(f"--defence {named}: expected one of {DEFENCES}")
        clash = [
            flag
            for flag, v in given.items()
            if v is not None and (named == "none" or flag != "--dp-delta")
        ] + ["--bottleneck-floor"] * (spec is not None and named == "none")
        if clash:
            raise ValueError(
                f"--defence {named} and {', '.join(clash)} contradict each other: "
                "give --defence, or the --dp-* flags"
                + (" (--dp-delta may join --defence recommended)" * (named != "none"))
            )
        if named == "recommended":
            return Recommended(
                DEFAULT_DELTA if delta is None else delta, bottleneck=spec
            )
    elif all(v is None for f, v in given.items() if f != "--dp-delta"):
        # no defence flag: the measured safe default (docs/privacy.md)
        return Recommended(
            DEFAULT_DELTA if delta is None else delta,
            implied=spec is None,
            bottleneck=spec,
        )

    def side(name: str, clip: float | None, noise: float | None) -> Gaussian | None:
        if noise is not None and clip is None:
            raise ValueError(
                f"--dp-{name}-noise needs --dp-{name}-clip: the noise is a multiple "
                "of the clipping bound"
            )
        return None if clip is None else Gaussian(clip, noise or 0.0)

    forward = side("forward", forward_clip, forward_noise)
    backward = side("backward", backward_clip, backward_noise)
    noisy = any(g and g.noise for g in (forward, backward)) or spec is not None
    if delta is not None and not noisy:
        raise ValueError(
            "--dp-delta: no Gaussian noise to account (give --dp-forward-noise or "
            "--dp-backward-noise with their clipping bounds)"
        )
    return CutDefence(
        forward=forward,
        backward=backward,
        embedding_dp=embedding_dp,
        delta=DEFAULT_DELTA if delta is None else delta,
        bottleneck=spec,
    )


# --- the mechanisms -------------------------------------------------------------------


def clip_rows(x: torch.Tensor, bound: float) -> torch.Tensor:
    """``x`` with every row (dim 0) scaled down to L2 norm ≤ ``bound``;
    differentiable, so A's own gradient flows through the clipping."""
    norms = x.detach().float().flatten(1).norm(dim=1)
    scale = (bound / norms.clamp(min=1e-12)).clamp(max=1.0)
    return x * scale.to(x.dtype).view(-1, *([1] * (x.dim() - 1)))


def gaussian_noise_like(
    x: torch.Tensor, std: float, generator: torch.Generator
) -> torch.Tensor:
    noise = torch.randn(x.shape, generator=generator, dtype=torch.float32)
    return (noise * std).to(device=x.device, dtype=x.dtype)


def flip_probability(epsilon: float) -> float:
    """EmbeddingDP's randomized response: a bit is flipped with probability
    1 / (1 + e^(ε/2)) (MindSpore Federated's ``EmbeddingDP``)."""
    return 1.0 / (1.0 + math.exp(epsilon / 2))


def embedding_dp(
    x: torch.Tensor, epsilon: float, generator: torch.Generator
) -> torch.Tensor:
    """1-bit quantisation (x > 0) and randomized response on every bit. The
    backward is the identity (straight-through), so A's front still trains."""
    bits = (x.detach() > 0).float()
    flips = torch.rand(x.shape, generator=generator) < flip_probability(epsilon)
    sent = torch.where(flips.to(x.device), 1.0 - bits, bits).to(x.dtype)
    return _StraightThrough.apply(x, sent)


class _StraightThrough(torch.autograd.Function):
    """``sent`` exactly on the way forward, the identity on the way back
    (``x + (sent - x).detach()`` would round the bits)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
        return sent

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class CutGuard:
    """A's defence at run time: ``activations`` and ``gradient`` return what
    is sent in place of the true tensors. ``secret`` seeds the noise; it stays
    in A's run folder."""

    def __init__(
        self, defence: CutDefence, secret: int, bottleneck: Bottleneck | None = None
    ) -> None:
        """``bottleneck``: the run's trained bottleneck (A's module), which a
        defence with one needs."""
        if (defence.bottleneck is None) != (bottleneck is None):
            raise ValueError(
                "a trained bottleneck's defence runs with its module, and only then"
            )
        self.defence = defence
        self.secret = secret
        self.bottleneck = bottleneck

    def _generator(self, *where: object) -> torch.Generator:
        key = ":".join(map(str, (self.secret, *where))).encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        return torch.Generator().manual_seed(seed >> 1)

    def activations(self, h: torch.Tensor, *where: object) -> torch.Tensor:
        return self.defend(h, *where)[0]

    def defend(
        self, h: torch.Tensor, *where: object
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(what is sent for ``h``, A's training term of the mechanism, if
        it has one: a trained bottleneck's ``β · C``)."""
        if self.bottleneck is not None:
            return self.bottleneck(h, self._generator("act", *where))
        return self._activations(h, *where), None

    def _activations(self, h: torch.Tensor, *where: object) -> torch.Tensor:
        d = self.defence
        if d.embedding_dp is not None:
            return embedding_dp(h, d.embedding_dp, self._generator("act", *where))
        if d.forward is None:
            return h
        h = clip_rows(h, d.forward.clip)
        if d.forward.noise == 0:
            return h
        std = d.forward.noise * d.forward.clip
        return h + gaussian_noise_like(h, std, self._generator("act", *where))

    def gradient(self, g: torch.Tensor, *where: object) -> torch.Tensor:
        b = self.defence.backward
        if b is None:
            return g
        g = clip_rows(g, b.clip)
        if b.noise == 0:
            return g
        return g + gaussian_noise_like(
            g, b.noise * b.clip, self._generator("grad", *where)
        )


# --- the budget -----------------------------------------------------------------------


def bottleneck_gaussian(spec: BottleneckSpec, coordinates: int) -> Gaussian | None:
    """The Gaussian mechanism a trained bottleneck is at least, per row of
    ``coordinates`` (positions × hidden): each token clipped to ``R`` puts
    the row within ``R·√T`` and its noise is at least ``floor · R / √H`` per
    coordinate, a multiplier ``floor / √(T·H)`` of the row's bound (centring
    on a constant changes nothing). None (unbounded) without a row size."""
    if not coordinates:
        return None
    return Gaussian(1.0, spec.floor / math.sqrt(coordinates))


def releases(rows_sent: int, dataset_rows: int) -> int:
    """How many times a row may have been sent after ``rows_sent`` rows were
    drawn in epochs of ``dataset_rows`` (each epoch a permutation)."""
    return math.ceil(rows_sent / dataset_rows) if rows_sent > 0 else 0


def epsilon(
    defence: CutDefence, k: int, *, backward: bool = True, coordinates: int = 0
) -> float:
    """ε (at ``defence.delta``) of ``k`` releases of one row through
    ``defence`` (``backward``: the gradient too, as in training; evaluation
    sends activations only). ``inf`` when a direction crosses without noise.

    EmbeddingDP is ε-LDP per coordinate: a row of ``coordinates`` bits
    (positions × hidden size) composes to ``ε · coordinates`` per release.
    """
    if k == 0:
        return 0.0
    pure = 0.0  # EmbeddingDP's part: pure ε composes by adding
    gaussians = [defence.backward] if backward else []
    if defence.embedding_dp is not None:
        pure = defence.embedding_dp * coordinates * k if coordinates else math.inf
    elif defence.bottleneck is not None:
        gaussians.append(bottleneck_gaussian(defence.bottleneck, coordinates))
    else:
        gaussians.append(defence.forward)
    if any(g is None or g.noise == 0 for g in gaussians) or math.isinf(pure):
        return math.inf
    if not gaussians:
        return pure
    # Replacing one row moves its clipped tensor by up to 2·clip.
    sigmas = [g.noise / 2 for g in gaussians]
    return pure + accountant.epsilon(sigmas, 1.0, k, defence.delta)

"""Trained attacks on what crosses the cut, stronger than ``attacks.py``'s
linear and windowed decoders (issue 38, item 5).

B knows the mechanism A applies and its strength, not the noise draws nor
A's private weights, so each attacker here is trained on public text that B
runs through its best model of A's front *and the same mechanism*:

* ``SequenceInverter``: a small bidirectional transformer that reads the
  whole sequence of features (activations, or received gradients) and
  predicts the token at every position. Published inverters of this kind
  read deep layers (arXiv 2405.11916) and noisy activations (BiSR, arXiv
  2409.00960): a position's own feature is only part of the evidence, the
  copies the front blocks spread to later positions and the language's
  redundancy are the rest.
* ``known_plaintext``: the same inverter, fine-tuned further on some of A's
  own (text, feature) pairs. An upper bound that measures how invertible
  A's map is, not just how secret its weights are.
* ``SimilarityInference``: label inference by cosine similarity to one
  reference direction per token (arXiv 2203.05222), which recovers labels
  close to completely from gradients or smashed data through DP-SGD-style
  noise. No training loop: a mean per token, then one matrix product.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from aisyn.privacy.attacks import as_features, recovery

#: rows per forward pass at prediction time (bounds the (rows, T, V) logits)
PREDICT_ROWS = 64


@dataclass(frozen=True)
class InverterSettings:
    """Size and training of B's sequence inverter and of the known-plaintext
    bound (0 ``known_pairs``: no known-plaintext attack)."""

    width: int = 128  # the transformer's model width
    layers: int = 2
    heads: int = 4
    steps: int = 300  # Adam steps on the public material
    lr: float = 1e-3
    batch: int = 16  # rows per step
    known_pairs: int = 256  # A's own rows the known-plaintext attacker holds
    known_steps: int = 100  # further steps on those rows
    # Public rows the inverter and the similarity references read: more than
    # the linear and in-context decoders' own (0: the same rows), as those
    # cost far more per row and B has as much public text as it likes.
    public_rows: int = 0

    def __post_init__(self) -> None:
        for name in ("width", "layers", "heads", "steps", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"inverter {name} must be >= 1, got {getattr(self, name)}"
                )
        for name in ("known_pairs", "known_steps", "public_rows"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"inverter {name} must be >= 0, got {getattr(self, name)}"
                )
        if self.width % self.heads:
            raise ValueError(
                f"inverter width {self.width} must be a multiple of its "
                f"{self.heads} heads"
            )
        if not self.lr > 0:
            raise ValueError(f"inverter lr must be > 0, got {self.lr}")


def _check_pairs(feats: torch.Tensor, tokens: torch.Tensor, dim: int) -> None:
    if feats.dim() != 3 or feats.shape[-1] != dim:
        raise ValueError(f"features must be (B, T, {dim}), got {tuple(feats.shape)}")
    if tokens.shape != feats.shape[:2]:
        raise ValueError(
            f"tokens {tuple(tokens.shape)} do not match features {tuple(feats.shape)}"
        )


class SequenceInverter(nn.Module):
    """Features (B, T, C) of a whole sequence -> the token at every position.

    Whitened features go through a linear projection, learned positions, a
    bidirectional pre-LN transformer encoder and a linear head. The head
    names only the tokens its training rows carried (``vocabulary``): a
    token B never saw it could not learn to name anyway, and the head over
    the full vocabulary is most of the cost. ``normalise``: each position's
    feature is scaled to unit length first, as for gradients (their scale is
    A's loss normalisation, not the token's; ``LearnedDecoder(normalise=True)``
    does the same)."""

    def __init__(
        self,
        dim: int,
        vocab: int,
        max_len: int,
        *,
        width: int = 128,
        layers: int = 2,
        heads: int = 4,
        normalise: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.dim, self.vocab, self.max_len = dim, vocab, max_len
        self.normalise = normalise
        self.width, self.seed = width, seed
        # The initial weights come from ``seed`` alone, not from whatever the
        # global generator holds: the same fit twice gives the same attacker.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.proj = nn.Linear(dim, width)
            self.pos = nn.Parameter(0.02 * torch.randn(max_len, width))
            layer = nn.TransformerEncoderLayer(
                width,
                heads,
                4 * width,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            self.encoder = nn.TransformerEncoder(
                layer, layers, enable_nested_tensor=False
            )
            self.norm = nn.LayerNorm(width)
        self.head: nn.Linear | None = None  # set by ``cover``
        self.register_buffer("vocabulary", torch.zeros(0, dtype=torch.long))
        # B's whitening, from the public features (set by ``fit``)
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    def cover(self, tokens: torch.Tensor) -> None:
        """Give the head a row for every token of ``tokens`` it lacks. The
        first rows are initialised from the seed; rows added later (a
        fine-tune's new tokens) start as unlikely as the least likely known
        token, so they take nothing from what was learned until trained."""
        t = tokens[tokens >= 0]
        if t.numel() and int(t.max()) >= self.vocab:
            raise ValueError(
                f"token {int(t.max())} is outside the vocabulary of {self.vocab}"
            )
        new = t.unique()
        new = new[~torch.isin(new, self.vocabulary)]
        if not new.numel():
            return
        # the head's draws come from the seed, and leave the global generator
        # as they found it
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + 1)
            head = nn.Linear(self.width, len(self.vocabulary) + len(new))
        if self.head is None:
            self.head = head
        else:
            old, self.head = self.head, head
            with torch.no_grad():
                self.head.weight.zero_()
                self.head.weight[: len(self.vocabulary)] = old.weight
                self.head.bias.fill_(float(old.bias.min()))
                self.head.bias[: len(self.vocabulary)] = old.bias
        self.vocabulary = torch.cat([self.vocabulary, new])

    def _targets(self, tokens: torch.Tensor) -> torch.Tensor:
        """Each token's row of the head (-100, cross_entropy's ignore, where
        the position carries no label: a negative token)."""
        row = torch.full((self.vocab,), -100, dtype=torch.long)
        row[self.vocabulary] = torch.arange(len(self.vocabulary))
        return torch.where(tokens >= 0, row[tokens.clamp_min(0)], -100)

    def _x(self, feats: torch.Tensor) -> torch.Tensor:
        return (as_features(feats, self.normalise) - self.mean) / self.std

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) for features (B, T, C), over ``vocabulary``."""
        if self.head is None:
            raise ValueError("this inverter is not fitted yet: call fit first")
        T = feats.shape[1]
        if T > self.max_len:
            raise ValueError(
                f"{T} positions: this inverter reads at most {self.max_len}"
            )
        h = self.proj(self._x(feats)) + self.pos[:T]  # (B, T, W)
        return self.head(self.norm(self.encoder(h)))  # (B, T, V)

    def fit(
        self,
        feats: torch.Tensor,
        tokens: torch.Tensor,
        *,
        steps: int = 300,
        lr: float = 1e-3,
        batch: int = 16,
        seed: int = 0,
    ) -> SequenceInverter:
        """Whiten by the features' own statistics, then ``train_on`` them."""
        _check_pairs(feats, tokens, self.dim)
        x = as_features(feats, self.normalise).reshape(-1, self.dim)
        self.mean.copy_(x.mean(0))
        self.std.copy_(x.std(0).clamp_min(1e-6))
        return self.train_on(feats, tokens, steps=steps, lr=lr, batch=batch, seed=seed)

    def train_on(
        self,
        feats: torch.Tensor,
        tokens: torch.Tensor,
        *,
        steps: int,
        lr: float,
        batch: int,
        seed: int = 0,
    ) -> SequenceInverter:
        """``steps`` Adam steps of cross-entropy on ``batch`` rows drawn (with
        ``seed``) from (features, tokens), keeping the whitening as it is (a
        fine-tune reads the new rows as the public ones were read). Positions
        whose token is negative carry no label."""
        _check_pairs(feats, tokens, self.dim)
        self.cover(tokens)
        targets = self._targets(tokens)
        g = torch.Generator().manual_seed(seed)
        opt = torch.optim.Adam(self.parameters(), lr=lr)
        self.train()
        for _ in range(steps):
            idx = torch.randint(len(feats), (min(batch, len(feats)),), generator=g)
            logits = self(feats[idx])
            loss = F.cross_entropy(logits.flatten(0, 1), targets[idx].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return self.eval()

    @torch.no_grad()
    def predict(self, feats: torch.Tensor) -> torch.Tensor:
        """Token guesses (B, T), ``PREDICT_ROWS`` rows at a time."""
        self.eval()
        rows = [self(part).argmax(-1) for part in feats.split(PREDICT_ROWS)]
        return self.vocabulary[torch.cat(rows)]


def known_plaintext(
    inverter: SequenceInverter,
    feats: torch.Tensor,
    tokens: torch.Tensor,
    *,
    steps: int = 100,
    lr: float = 1e-3,
    batch: int = 16,
    seed: int = 0,
) -> SequenceInverter:
    """A copy of ``inverter`` (fitted on public material) fine-tuned on A's
    own (features, tokens) pairs: the attacker who also holds some of A's
    text and what it sent. The rows must be disjoint from the rows attacked.

    The attacker holds out an eighth of its pairs and keeps the checkpoint
    that reads them best (the public-only one included), as anyone with
    labelled pairs would: a fine-tune on a few hundred rows can overfit, and
    the bound should not fall below what B had without them."""
    _check_pairs(feats, tokens, inverter.dim)
    if len(feats) < 2:
        raise ValueError(f"known plaintext needs at least 2 pairs, got {len(feats)}")
    held = max(1, len(feats) // 8)
    fit_x, fit_y = feats[held:], tokens[held:]
    val_x, val_y = feats[:held], tokens[:held]
    tuned = copy.deepcopy(inverter)
    tuned.cover(tokens)  # A's tokens B never saw: before the first checkpoint
    rounds = min(5, max(1, steps))  # checkpoints considered after step 0
    best = (recovery(tuned.predict(val_x), val_y), copy.deepcopy(tuned.state_dict()))
    done = 0
    for r in range(rounds):
        n = (steps * (r + 1)) // rounds - done
        done += n
        # one optimiser per round: Adam's moments restart, a small price for
        # checkpoints that need no extra state
        tuned.train_on(fit_x, fit_y, steps=n, lr=lr, batch=batch, seed=seed + r)
        score = recovery(tuned.predict(val_x), val_y)
        if score > best[0]:
            best = (score, copy.deepcopy(tuned.state_dict()))
    tuned.load_state_dict(best[1])
    return tuned.eval()


class SimilarityInference:
    """Token by cosine similarity (arXiv 2203.05222): B builds one reference
    direction per token, the mean of the (centred, unit-length) features of
    the public positions that carry it, and guesses for each received feature
    the token whose reference it points along most.

    Features are centred on the public mean at their position before their
    direction is taken: activations are dominated by a part that does not
    depend on the token (docs/privacy.md's facts: rms 0.72 against 0.055 for
    the token's part), which would otherwise make every direction alike.
    ``normalise``: each feature is scaled to unit length first (gradients)."""

    def __init__(self, vocab: int, *, normalise: bool = False) -> None:
        self.vocab = vocab
        self.normalise = normalise

    def _directions(self, feats: torch.Tensor) -> torch.Tensor:
        x = as_features(feats, self.normalise)
        T = x.shape[1]
        if T > len(self.centre):
            raise ValueError(
                f"{T} positions: the references were built on {len(self.centre)}"
            )
        return F.normalize(x - self.centre[:T], dim=-1)  # (B, T, C)

    def fit(self, feats: torch.Tensor, tokens: torch.Tensor) -> SimilarityInference:
        _check_pairs(feats, tokens, feats.shape[-1])
        # (T, C): the position's token-independent part
        self.centre = as_features(feats, self.normalise).mean(0)
        d = self._directions(feats).reshape(-1, feats.shape[-1])
        y = tokens.reshape(-1)
        keep = y >= 0
        d, y = d[keep], y[keep]
        sums = torch.zeros(self.vocab, d.shape[-1]).index_add_(0, y, d)  # (V, C)
        self.refs = F.normalize(sums, dim=-1)
        # a token never seen in public text has no reference: never guessed
        self.seen = torch.bincount(y, minlength=self.vocab) > 0
        return self

    @torch.no_grad()
    def predict(self, feats: torch.Tensor) -> torch.Tensor:
        """Token guesses (B, T): the most similar reference at each position."""
        sim = self._directions(feats) @ self.refs.T  # (B, T, V)
        return sim.masked_fill(~self.seen, float("-inf")).argmax(-1)

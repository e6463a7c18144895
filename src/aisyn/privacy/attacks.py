"""What an honest-but-curious compute party can recover from what crosses.

B holds the middle of the model. In every training step it receives the
activations of the front cut (A's embedding and front blocks applied to A's
tokens) and the gradient of the loss with respect to its own output (which
A's back blocks and head turn into logits against A's labels, the next
tokens). These attacks play B with knowledge of the weights of A's pieces —
the realistic case when both start from a public base model, which B may
assume A has barely moved from:

* ``invert_activations`` (white-box optimisation): find soft input tokens
  whose front activations match the received ones; their argmax is the guess.
* ``infer_labels`` (white-box gradient matching): find soft labels whose loss
  gradient, through A's back pieces at B's own output, points as the received
  gradient does, position by position.
* ``LearnedDecoder`` (learned inversion): a linear map from a position's
  activation (or received gradient) to its token, trained on public text of
  another domain that B runs through the same pieces itself.

All are written against the ``CausalLM`` pieces (``embed``, ``block``,
``finish``, ``logits``), so they attack every model family alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from aisyn.model.causal_lm import CausalLM

# A's pieces, run as a split run runs them (one implementation, shared with
# the calibration of the defences' clipping bounds).
from aisyn.split.defence.calibration import back_logits, front


def word_embedding(model: CausalLM) -> torch.Tensor:
    """The (V, C) word embedding (the first module of the embedding stage)."""
    return model.get_submodule(model.layout.embed[0]).weight


def invert_activations(
    model: CausalLM,
    acts: torch.Tensor,
    blocks: range,
    *,
    steps: int = 200,
    lr: float = 0.1,
) -> torch.Tensor:
    """Token guesses (B, T) for front activations ``acts`` (B, T, C) that
    ``model``'s embedding and ``blocks`` produced (white-box optimisation over
    a softmax relaxation of the input tokens)."""
    emb = word_embedding(model).detach()
    B, T, _ = acts.shape
    zeros = torch.zeros(B, T, dtype=torch.long, device=acts.device)
    # embed() = word part + (position part, if any): the latter, once.
    position_part = (model.embed(zeros) - emb[zeros]).detach()
    z = torch.zeros(B, T, emb.shape[0], device=acts.device, requires_grad=True)
    opt = torch.optim.Adam([z], lr=lr)
    target = acts.detach()
    scale = target.pow(2).mean().clamp_min(1e-12)
    for _ in range(steps):
        x = torch.softmax(z, dim=-1) @ emb + position_part
        loss = (front(model, x, blocks) - target).pow(2).mean() / scale
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return z.detach().argmax(-1)


def infer_labels(
    model: CausalLM,
    h: torch.Tensor,
    grad: torch.Tensor,
    blocks: range,
    *,
    steps: int = 200,
    lr: float = 0.1,
) -> torch.Tensor:
    """Label guesses (B, T) at every position from the gradient ``grad`` of
    the loss with respect to B's output ``h`` (both (B, T, C)), through A's
    back ``blocks`` and head: soft labels are fitted so that their
    cross-entropy gradient has, at each position, the direction of the
    received one (directions, because the loss's normalisation is A's)."""
    h = h.detach()
    target = grad.detach()
    # First order: the received gradient is J^T (p - onehot(label)) / N at
    # each position (J the logits' Jacobian), so J g is lowest at the label.
    # One Jacobian-vector product scores every candidate; the fit refines it.
    with sdpa_kernel(SDPBackend.MATH):
        _, jg = torch.func.jvp(lambda x: back_logits(model, x, blocks), (h,), (target,))
    score = -jg.float()
    score = score / score.std(dim=-1, keepdim=True).clamp_min(1e-12)
    z = score.clone().requires_grad_(True)
    opt = torch.optim.Adam([z], lr=lr)
    # The fitted gradient is differentiated again: only SDPA's math kernel
    # has a second derivative.
    with sdpa_kernel(SDPBackend.MATH):
        for _ in range(steps):
            _match_step(model, h, target, z, opt, blocks)
    return z.detach().argmax(-1)


@torch.no_grad()
def base_head_labels(model: CausalLM, out: torch.Tensor, blocks: range) -> torch.Tensor:
    """Label guesses (B, T) from B's output ``out`` alone: ``model``'s back
    ``blocks`` and head on it, the most likely next token -- what B knows of
    the labels with no gradient at all (in LM fine-tuning they are the next
    inputs, so the forward channel carries them too)."""
    return back_logits(model, out, blocks).argmax(-1)


def _match_step(model, h, target, z, opt, blocks) -> None:
    """One step of ``infer_labels``: move the soft labels ``z`` so that their
    loss gradient at ``h`` turns towards ``target``, position by position."""
    hx = h.clone().requires_grad_(True)
    logp = torch.log_softmax(back_logits(model, hx, blocks).float(), dim=-1)
    loss_ce = -(torch.softmax(z, dim=-1) * logp).sum()
    (g,) = torch.autograd.grad(loss_ce, hx, create_graph=True)
    cos = F.cosine_similarity(g, target, dim=-1, eps=1e-12)
    loss = (1 - cos).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def as_features(feats: torch.Tensor, normalise: bool) -> torch.Tensor:
    """What a trained decoder reads of ``feats``: floats, each position's
    scaled to unit length where ``normalise`` (gradients: their scale is A's
    loss normalisation, not the token's)."""
    x = feats.float()
    return F.normalize(x, dim=-1) if normalise else x


class LearnedDecoder:
    """A map from a position's feature (an activation, or a received gradient
    normalised to unit length) to the token at that position, fitted by
    cross-entropy on public (feature, token) pairs.

    The plain decoder is linear and reads one position. ``context`` > 0 lets
    it read the ``context`` positions either side too, and ``hidden`` > 0 puts
    an MLP layer of that width in front: against noise drawn afresh for every
    position this is the stronger attack, since the front blocks copy each
    token into later positions (B can average its noisy copies) and
    neighbours carry the language's own redundancy.
    """

    def __init__(
        self,
        dim: int,
        vocab: int,
        *,
        normalise: bool = False,
        context: int = 0,
        hidden: int = 0,
    ) -> None:
        self.normalise = normalise
        self.context = context
        width = dim * (2 * context + 1)
        if hidden:
            self.net = torch.nn.Sequential(
                torch.nn.Linear(width, hidden),
                torch.nn.GELU(),
                torch.nn.Linear(hidden, vocab),
            )
        else:
            self.net = torch.nn.Linear(width, vocab)

    def _x(self, feats: torch.Tensor) -> torch.Tensor:
        x = as_features(feats, self.normalise)
        if self.context:  # (B, T, C) -> (B, T, (2k+1)·C): each position's window
            k = self.context
            padded = F.pad(x, (0, 0, k, k))
            x = padded.unfold(1, 2 * k + 1, 1).transpose(-1, -2).flatten(-2)
        return x.reshape(-1, x.shape[-1])

    def fit(
        self,
        feats: torch.Tensor,
        tokens: torch.Tensor,
        *,
        epochs: int = 30,
        lr: float = 1e-2,
        batch: int = 4096,
        seed: int = 0,
    ) -> LearnedDecoder:
        x, y = self._x(feats), tokens.reshape(-1)
        keep = y >= 0
        x, y = x[keep], y[keep]
        self.mean, self.std = torch.zeros(()), torch.ones(())
        if not self.normalise:  # whiten by the public features' own statistics
            self.mean, self.std = x.mean(0), x.std(0).clamp_min(1e-6)
        x = (x - self.mean) / self.std
        g = torch.Generator().manual_seed(seed)
        opt = torch.optim.Adam(self.net.parameters(), lr=lr)
        for _ in range(epochs):
            for idx in torch.randperm(len(y), generator=g).split(batch):
                loss = F.cross_entropy(self.net(x[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        return self

    @torch.no_grad()
    def predict(self, feats: torch.Tensor) -> torch.Tensor:
        x = (self._x(feats) - self.mean) / self.std
        return self.net(x).argmax(-1).reshape(feats.shape[:-1])


def context_decoder(
    feats: torch.Tensor, tokens: torch.Tensor, vocab: int
) -> LearnedDecoder:
    """B's strongest forward decoder, fitted: an MLP over a window of five
    positions (a linear one-position decoder underrates what B learns from
    noised activations)."""
    decoder = LearnedDecoder(feats.shape[-1], vocab, context=2, hidden=512)
    return decoder.fit(feats, tokens, epochs=10, lr=3e-3)


def recovery(guess: torch.Tensor, truth: torch.Tensor) -> float:
    """Share of positions (truth >= 0) whose token is guessed exactly."""
    keep = truth >= 0
    return float((guess[keep] == truth[keep]).float().mean())


def frequent_token_rate(truth: torch.Tensor) -> float:
    """What always guessing the single most frequent token gets (a baseline
    that needs no attack; B learns the frequency from public text anyway)."""
    t = truth[truth >= 0]
    return float(torch.bincount(t).max()) / max(1, t.numel())

"""Cloze accuracy: rank each item's candidates by the model's log-likelihood.

Two formats, matching how a model was trained:

* ``lm`` (zero-shot, for language models): the context is ``<eod> + prefix``; a
  candidate is scored on the tokens of *candidate + the rest of its sentence*
  (the suffix up to and including the first sentence end, at most
  ``REST_CHARS`` characters). The score is the **mean log-probability per
  token** of that continuation. Summed log-probabilities would favour
  candidates that tokenise into fewer pieces; the mean does not (a model that
  is indifferent between tokens gives every candidate the same score, however
  long — see tests/test_cloze.py), and scoring the rest of the sentence lets the
  context after the blank vote too.
* ``prompt`` (for models fine-tuned on supervised cloze items): the context is
  the passage with the blank marked (``data.cloze.prompt_text``); a candidate is
  scored on its tokens followed by ``<eod>``, again as a mean per token.

An item is correct when the answer scores highest (ties go to the first).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from aisyn.data.cloze import ClozeItem, prompt_text
from aisyn.data.tokenizer import PanguTokenizer

REST_CHARS = 32
_SENTENCE_END = re.compile(r"[。！？!?；;\n]")
FORMATS = ("lm", "prompt")


def rest_of_sentence(suffix: str) -> str:
    m = _SENTENCE_END.search(suffix[:REST_CHARS])
    return suffix[: m.end()] if m else suffix[:REST_CHARS]


@dataclass
class Scored:
    """One item's sequences: shared context ids, one continuation per candidate."""

    context: list[int]
    continuations: list[list[int]]
    label: int


def encode_item(
    item: ClozeItem, tok: PanguTokenizer, max_len: int, fmt: str = "lm"
) -> Scored:
    if fmt == "lm":
        rest = rest_of_sentence(item.suffix)
        conts = [tok.encode(c + rest) for c in item.candidates]
        context = [tok.eod_id, *tok.encode(item.prefix)]
    elif fmt == "prompt":
        conts = [[*tok.encode(c), tok.eod_id] for c in item.candidates]
        longest = max(len(c) for c in conts)
        # Characters are >= tokens here (~1.1 chars/token), so trimming the passage
        # to the token budget in characters always fits; the final cut below is
        # only a guard.
        context = [tok.eod_id, *tok.encode(prompt_text(item, max_len - longest - 8))]
    else:
        raise ValueError(f"unknown cloze format {fmt!r}; expected one of {FORMATS}")
    longest = max(len(c) for c in conts)
    if longest >= max_len:
        conts = [c[: max_len // 2] for c in conts]
        longest = max(len(c) for c in conts)
    keep = max_len - longest
    if len(context) > keep:  # keep the end of the context: it is next to the blank
        context = context[len(context) - keep :]
    return Scored(context, conts, item.label)


@torch.no_grad()
def score_items(
    model: torch.nn.Module,
    items: Sequence[Scored],
    *,
    batch_size: int = 32,
    pad_id: int = 0,
    device: torch.device | str = "cpu",
) -> list[np.ndarray]:
    """Mean per-token log-probability of every candidate continuation.

    Sequences are right-padded; with causal attention padding never affects
    the positions that are scored. ``model.hidden`` + ``model.logits`` are used
    so logits are computed only at scored positions.
    """
    seqs, owners = [], []
    for n, it in enumerate(items):
        for c in it.continuations:
            seqs.append((it.context, c))
            owners.append(n)
    scores = np.zeros(len(seqs))
    # Longest first keeps padding low within each batch.
    order = sorted(range(len(seqs)), key=lambda i: -(len(seqs[i][0]) + len(seqs[i][1])))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        T = max(len(seqs[i][0]) + len(seqs[i][1]) for i in idx) - 1
        tokens = torch.full((len(idx), T), pad_id, dtype=torch.long)
        rows, cols, targets = [], [], []
        for r, i in enumerate(idx):
            ctx, cont = seqs[i]
            full = ctx + cont
            tokens[r, : len(full) - 1] = torch.tensor(full[:-1])
            # position p predicts token p+1: continuation tokens sit at
            # len(ctx) .. len(full)-1, predicted from len(ctx)-1 .. len(full)-2
            pos = range(len(ctx) - 1, len(full) - 1)
            rows.extend([r] * len(cont))
            cols.extend(pos)
            targets.extend(cont)
        h = model.hidden(tokens.to(device))
        logits = model.logits(h[torch.tensor(rows), torch.tensor(cols)]).float()
        logp = F.log_softmax(logits, dim=-1)
        tok_lp = logp[torch.arange(len(targets)), torch.tensor(targets)].cpu()
        sums = torch.zeros(len(idx)).index_add_(0, torch.tensor(rows), tok_lp)
        counts = torch.bincount(torch.tensor(rows), minlength=len(idx)).clamp(min=1)
        for r, i in enumerate(idx):
            scores[i] = float(sums[r] / counts[r])
    out: list[list[float]] = [[] for _ in items]
    for i, n in enumerate(owners):
        out[n].append(scores[i])
    return [np.asarray(s) for s in out]


def bootstrap_ci(
    correct: np.ndarray, n_boot: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the mean of 0/1 outcomes."""
    if len(correct) == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = rng.choice(correct, size=(n_boot, len(correct)), replace=True).mean(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def cloze_accuracy(
    model: torch.nn.Module,
    items: Sequence[ClozeItem],
    tok: PanguTokenizer,
    *,
    fmt: str = "lm",
    max_len: int | None = None,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
) -> dict:
    """Accuracy, item count, chance level and bootstrap 95 % interval."""
    if not items:
        raise ValueError("no cloze items to score")
    max_len = max_len or model.config.seq_len
    was_training = model.training
    model.eval()
    encoded = [encode_item(it, tok, max_len, fmt) for it in items]
    scores = score_items(
        model, encoded, batch_size=batch_size, pad_id=tok.pad_id, device=device
    )
    model.train(was_training)
    correct = np.array(
        [int(np.argmax(s) == e.label) for s, e in zip(scores, encoded, strict=True)]
    )
    lo, hi = bootstrap_ci(correct)
    chance = float(np.mean([1 / len(it.candidates) for it in items]))
    return {
        "accuracy": float(correct.mean()),
        "items": len(items),
        "ci95": [lo, hi],
        "chance": chance,
        "format": fmt,
    }

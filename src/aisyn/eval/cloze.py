"""Cloze accuracy: rank each item's candidates by the model's log-likelihood.

Two formats, matching how a model was trained:

* ``lm`` (zero-shot, for language models): the context is ``<eod> + prefix``; a
  candidate is scored on the tokens of *candidate + the rest of its sentence*
  (the suffix up to and including the first sentence end, at most
  ``REST_CHARS`` characters). The score is the **mean log-probability per
  token** of that continuation. Summed log-probabilities would favour
  candidates that tokenise into fewer pieces; the mean does not (a model that
  is indifferent between tokens gives every candidate the same score, however
  long — see tests/eval/test_cloze.py), and scoring the rest of the sentence
  lets the context after the blank vote too.
* ``prompt`` (for models fine-tuned on supervised cloze items): the context is
  the passage with the blank marked (``data.cloze.prompt_text``); a candidate is
  scored on its tokens followed by ``<eod>``, again as a mean per token.

An item is correct when the answer scores highest (ties go to the first).

Two scorers compute these scores. ``score_packed``, the default, runs each item
as *one* sequence::

    context | cand_1[:-1] | cand_2[:-1] | ... | cand_n[:-1]

with an attention mask that lets each candidate's tokens see the context and
their own earlier tokens only, and position ids that restart at
``len(context)`` for every candidate: the same keys at the same positions as a
sequence of the context and that candidate alone, so the same scores (up to
float summation order), with the shared context — most of the tokens —
computed once instead of once per candidate. ``score_per_candidate`` runs
exactly those separate sequences; it is the packed scorer's test oracle and
the path for models that cannot take an arbitrary mask (``packs``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from aisyn.data.cloze import ClozeItem, prompt_text
from aisyn.data.tokenizer import Tokenizer
from aisyn.model.causal_lm import CausalLM

REST_CHARS = 32
#: Tokens encoded beyond the context a long prefix fills (``encode_tail``).
TAIL_SPARE_TOKENS = 16
_SENTENCE_END = re.compile(r"[。！？!?；;\n]")
FORMATS = ("lm", "prompt")
# Logits (in elements) made at once by the packed scorer: 2 MiB of float32 stays
# in a CPU core's L2 cache; an accelerator wants large blocks.
LOGIT_CHUNK_CPU = 2**19
LOGIT_CHUNK = 2**26


def rest_of_sentence(suffix: str) -> str:
    m = _SENTENCE_END.search(suffix[:REST_CHARS])
    return suffix[: m.end()] if m else suffix[:REST_CHARS]


# --- encoding -----------------------------------------------------------------------


@dataclass
class EncodedItem:
    """One item's token ids: shared context, one continuation per candidate."""

    context: list[int]
    continuations: list[list[int]]
    label: int


def encode_tail(text: str, tok: Tokenizer, tokens: int) -> list[int] | None:
    """The last ``tokens`` tokens of ``text``, from the encoding of its tail
    alone; None when all of ``text`` is no more than that.

    A prefix longer than the model's context needs only its end, and
    encoding all of it costs time in its length (a 200 000-character prefix
    ran for minutes). The tail is doubled until it gives ``TAIL_SPARE_TOKENS``
    more than needed: those absorb the cut, where a word may be split, so the
    tokens kept are the ones the whole text gives (tokenisation is local).
    """
    chars = 2 * (tokens + TAIL_SPARE_TOKENS)
    while chars < len(text):
        ids = tok.encode(text[-chars:])
        if len(ids) >= tokens + TAIL_SPARE_TOKENS:
            return ids[len(ids) - tokens :]
        chars *= 2
    return None


def encode_item(
    item: ClozeItem, tok: Tokenizer, max_len: int, fmt: str = "lm"
) -> EncodedItem:
    if fmt == "lm":
        rest = rest_of_sentence(item.suffix)
        conts = [tok.encode(c + rest) for c in item.candidates]
        # what the model sees of the context (cut to ``keep`` below)
        longest = max(len(c) for c in conts)
        seen = max_len - (longest if longest < max_len else max_len // 2)
        tail = encode_tail(item.prefix, tok, seen)
        context = tail or [tok.eod_id, *tok.encode(item.prefix)]
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
    return EncodedItem(context, conts, item.label)


def encode_items(
    items: Sequence[ClozeItem], tok: Tokenizer, max_len: int, fmt: str = "lm"
) -> list[EncodedItem]:
    return [encode_item(it, tok, max_len, fmt) for it in items]


# --- the oracle: one sequence per candidate -------------------------------------------


@torch.no_grad()
def score_per_candidate(
    model: torch.nn.Module,
    items: Sequence[EncodedItem],
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


# --- the default: one packed sequence per item ----------------------------------------


@dataclass
class PackedItem:
    """One item as one sequence, and where each of its scored tokens is predicted.

    ``segment`` is 0 on the context and ``i + 1`` on candidate ``i``. Scored
    token ``j`` (``targets[j]``, of candidate ``candidate[j]``) is predicted
    from column ``source[j]``: a candidate's first token from the context's
    last column, its later tokens from its own previous ones.
    """

    tokens: np.ndarray
    segment: np.ndarray
    positions: np.ndarray
    source: np.ndarray
    targets: np.ndarray
    candidate: np.ndarray


def pack_item(item: EncodedItem) -> PackedItem:
    L = len(item.context)
    lengths = np.array([len(c) for c in item.continuations])
    fed = lengths - 1  # a candidate's last token is only ever a target
    fed_start = L + np.cumsum(fed) - fed  # column of each candidate's first fed token
    n_fed = int(fed.sum())
    # offset of every fed token / target within its own candidate
    fed_offset = np.arange(n_fed) - np.repeat(fed_start - L, fed)
    target_offset = np.arange(int(lengths.sum())) - np.repeat(
        np.cumsum(lengths) - lengths, lengths
    )
    return PackedItem(
        tokens=np.concatenate(
            [item.context, *(c[:-1] for c in item.continuations)]
        ).astype(np.int64),
        segment=np.repeat(np.arange(len(lengths) + 1), [L, *fed]),
        positions=np.concatenate([np.arange(L), L + fed_offset]),
        source=np.where(
            target_offset == 0,
            L - 1,
            np.repeat(fed_start, lengths) + target_offset - 1,
        ),
        targets=np.concatenate(item.continuations).astype(np.int64),
        candidate=np.repeat(np.arange(len(lengths)), lengths),
    )


def packed_mask(segment: torch.Tensor) -> torch.Tensor:
    """Attention mask (B, 1, T, T) of packed rows, True = may attend: causal,
    and a token sees the context (segment 0) and its own segment only."""
    T = segment.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segment.device).tril()
    keys, queries = segment[:, None, :], segment[:, :, None]
    return (causal & ((keys == 0) | (keys == queries))).unsqueeze(1)


def _stack(arrays: Sequence[np.ndarray], width: int, fill: int) -> torch.Tensor:
    out = np.full((len(arrays), width), fill, dtype=np.int64)
    for r, a in enumerate(arrays):
        out[r, : len(a)] = a
    return torch.from_numpy(out)


def _log_probs(
    model: CausalLM,
    states: torch.Tensor,
    which: np.ndarray,
    targets: np.ndarray,
    chunk_elements: int,
) -> torch.Tensor:
    """log p(``targets[j]``) from hidden state ``states[which[j]]`` (float64, CPU).

    Logits are made a chunk of states at a time: ``logsumexp`` reads them
    several times, which is cheap while a chunk stays in cache and costs as
    much as the projection itself once the whole (states, vocab) block does
    not.
    """
    rows = max(1, chunk_elements // model.config.vocab_size)
    by_state = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[by_state], np.arange(0, len(states) + rows, rows))
    out = torch.empty(len(which), dtype=torch.float64)
    for n, start in enumerate(range(0, len(states), rows)):
        logits = model.logits(states[start : start + rows]).float()
        lse = torch.logsumexp(logits, dim=-1)
        mine = by_state[bounds[n] : bounds[n + 1]]
        r = torch.from_numpy(which[mine] - start).to(logits.device)
        t = torch.from_numpy(targets[mine]).to(logits.device)
        out[torch.from_numpy(mine)] = (logits[r, t] - lse[r]).double().cpu()
    return out


@torch.no_grad()
def score_packed(
    model: CausalLM,
    items: Sequence[EncodedItem],
    *,
    batch_size: int = 16,
    pad_id: int = 0,
    device: torch.device | str = "cpu",
) -> list[np.ndarray]:
    """``score_per_candidate``'s scores, one packed sequence per item.

    Drives the model through its public ``hidden(tokens, mask, positions)``
    and ``logits``; a packed row may be longer than the model's ``seq_len``
    (its positions never are). Logits are computed once per distinct source
    column: every candidate's first token is predicted from the same one.
    """
    packed = [pack_item(it) for it in items]
    chunk = LOGIT_CHUNK_CPU if torch.device(device).type == "cpu" else LOGIT_CHUNK
    out: list[np.ndarray] = [np.zeros(0)] * len(items)
    # Longest first keeps padding low within each batch.
    order = sorted(range(len(packed)), key=lambda i: -len(packed[i].tokens))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = [packed[i] for i in idx]
        T = len(batch[0].tokens)
        tokens = _stack([p.tokens for p in batch], T, pad_id).to(device)
        segment = _stack([p.segment for p in batch], T, -1).to(device)
        positions = _stack([p.positions for p in batch], T, 0).to(device)
        h = model.hidden(tokens, packed_mask(segment), positions)
        # Every scored token's source as a flat (row * T + column), deduplicated.
        rows = np.repeat(np.arange(len(batch)), [len(p.targets) for p in batch])
        flat = rows * T + np.concatenate([p.source for p in batch])
        sources, which = np.unique(flat, return_inverse=True)
        states = h.reshape(-1, h.shape[-1])[torch.from_numpy(sources).to(h.device)]
        targets = np.concatenate([p.targets for p in batch])
        tok_lp = _log_probs(model, states, which, targets, chunk)
        # Mean per (row, candidate), one slot each.
        max_c = max(len(items[i].continuations) for i in idx)
        slot = torch.from_numpy(
            rows * max_c + np.concatenate([p.candidate for p in batch])
        )
        sums = torch.zeros(len(batch) * max_c, dtype=torch.float64)
        sums.index_add_(0, slot, tok_lp)
        counts = torch.bincount(slot, minlength=len(batch) * max_c).clamp(min=1)
        means = (sums / counts).view(len(batch), max_c).numpy()
        for r, i in enumerate(idx):
            out[i] = means[r, : len(items[i].continuations)].copy()
    return out


# --- choosing a scorer, and accuracy --------------------------------------------------


def packs(model: torch.nn.Module) -> bool:
    """Whether ``model`` can be scored packed: it must apply any attention mask
    it is given. ``CausalLM`` does. A split run's ``SplitModel`` does not —
    its compute party rebuilds only the EOD-reset mask of the run from document
    indices, so a packed mask would be silently replaced — and is scored one
    candidate per sequence."""
    return isinstance(model, CausalLM)


def score_items(
    model: torch.nn.Module,
    items: Sequence[EncodedItem],
    *,
    batch_size: int = 16,
    pad_id: int = 0,
    device: torch.device | str = "cpu",
) -> list[np.ndarray]:
    """Every candidate's score, packed where the model allows it (``packs``).

    ``batch_size`` counts items when packed, sequences otherwise.
    """
    score = score_packed if packs(model) else score_per_candidate
    was_training = model.training
    model.eval()
    try:
        return score(model, items, batch_size=batch_size, pad_id=pad_id, device=device)
    finally:
        model.train(was_training)


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


def encoded_accuracy(
    model: torch.nn.Module,
    encoded: Sequence[EncodedItem],
    *,
    fmt: str,
    batch_size: int = 16,
    pad_id: int = 0,
    device: torch.device | str = "cpu",
) -> dict:
    """``cloze_accuracy`` of items encoded beforehand (``encode_items``), for
    callers that score many models on the same items."""
    if not encoded:
        raise ValueError("no cloze items to score")
    scores = score_items(
        model, encoded, batch_size=batch_size, pad_id=pad_id, device=device
    )
    correct = np.array(
        [int(np.argmax(s) == e.label) for s, e in zip(scores, encoded, strict=True)]
    )
    lo, hi = bootstrap_ci(correct)
    return {
        "accuracy": float(correct.mean()),
        "items": len(encoded),
        "ci95": [lo, hi],
        "chance": float(np.mean([1 / len(e.continuations) for e in encoded])),
        "format": fmt,
    }


def cloze_accuracy(
    model: torch.nn.Module,
    items: Sequence[ClozeItem],
    tok: Tokenizer,
    *,
    fmt: str = "lm",
    max_len: int | None = None,
    batch_size: int = 16,
    device: torch.device | str = "cpu",
) -> dict:
    """Accuracy, item count, chance level and bootstrap 95 % interval."""
    if not items:
        raise ValueError("no cloze items to score")
    encoded = encode_items(items, tok, max_len or model.config.seq_len, fmt)
    return encoded_accuracy(
        model,
        encoded,
        fmt=fmt,
        batch_size=batch_size,
        pad_id=tok.pad_id,
        device=device,
    )

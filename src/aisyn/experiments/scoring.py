"""Cloze scoring with the context computed once per item, not once per candidate.

``eval.cloze.score_items`` runs one sequence per candidate (context + candidate),
so the shared context — nearly all the tokens — is recomputed ten times. Here
an item is *one* packed sequence::

    context | cand_1[:-1] | cand_2[:-1] | ... | cand_10[:-1]

with an attention mask that lets each candidate's tokens see the context and
their own earlier tokens only, and position ids that restart at
``len(context)`` for every candidate. Each candidate's first token is predicted
from the context's last position, later ones from the candidate's own tokens.
This is exactly the same computation as the per-candidate sequences (same keys,
same positions; only float summation order differs — see
tests/experiments/test_scoring.py), about 5-10x cheaper. Items are encoded with
``eval.cloze.encode_item`` so both scorers see identical token ids.

The model is driven through its public pieces (embeddings, blocks,
``top_query``, ``logits``); the packed sequence may be longer than the model's
``seq_len`` (positions never are), so ``PanguAlpha.embed``'s length check is
bypassed on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from aisyn.data.cloze import ClozeItem
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.eval.cloze import Scored, bootstrap_ci, encode_item
from aisyn.model.pangu import PanguAlpha


def encode_items(
    items: Sequence[ClozeItem], tok: PanguTokenizer, max_len: int, fmt: str
) -> list[Scored]:
    return [encode_item(it, tok, max_len, fmt) for it in items]


def _pack(item: Scored, T: int, pad_id: int):
    """Token ids, segment ids (0 context, i+1 candidate i, -1 pad), positions,
    and (column, target, candidate) of every scored token."""
    L = len(item.context)
    tokens = np.full(T, pad_id, dtype=np.int64)
    seg = np.full(T, -1, dtype=np.int64)
    pos = np.zeros(T, dtype=np.int64)
    tokens[:L], seg[:L], pos[:L] = item.context, 0, np.arange(L)
    cols, targets, owner = [], [], []
    at = L
    for i, cont in enumerate(item.continuations):
        k = len(cont) - 1  # the last token is only ever a target
        tokens[at : at + k] = cont[:-1]
        seg[at : at + k] = i + 1
        pos[at : at + k] = np.arange(L, L + k)
        cols.extend([L - 1, *range(at, at + k)])
        targets.extend(cont)
        owner.extend([i] * len(cont))
        at += k
    return tokens, seg, pos, cols, targets, owner


def packed_length(item: Scored) -> int:
    return len(item.context) + sum(len(c) - 1 for c in item.continuations)


@torch.no_grad()
def score_packed(
    model: PanguAlpha,
    items: Sequence[Scored],
    *,
    batch_size: int = 16,
    pad_id: int = 0,
    device: torch.device | str = "cpu",
) -> list[np.ndarray]:
    """Mean per-token log-probability of every candidate of every item."""
    was_training = model.training
    model.eval()
    out: list[np.ndarray] = [np.zeros(len(it.continuations)) for it in items]
    order = sorted(range(len(items)), key=lambda i: -packed_length(items[i]))
    tr = model.transformer
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        T = max(packed_length(items[i]) for i in idx)
        packs = [_pack(items[i], T, pad_id) for i in idx]
        tokens = torch.from_numpy(np.stack([p[0] for p in packs])).to(device)
        seg = torch.from_numpy(np.stack([p[1] for p in packs])).to(device)
        pos = torch.from_numpy(np.stack([p[2] for p in packs])).to(device)
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])
        mask = (causal & same).unsqueeze(1)  # (B, 1, T, T): True = may attend
        x = tr.drop(tr.wte(tokens) + tr.wpe(pos))
        for block in tr.h[:-1]:
            x = block(x, mask)
        h = model.top_query(x, mask, pos)
        rows = torch.tensor([r for r, p in enumerate(packs) for _ in p[3]])
        cols = torch.tensor([c for p in packs for c in p[3]])
        targets = torch.tensor([t for p in packs for t in p[4]])
        logp = F.log_softmax(model.logits(h[rows, cols]).float(), dim=-1)
        tok_lp = logp[torch.arange(len(targets)), targets.to(device)].cpu().double()
        # one slot per (item in batch, candidate): sum then mean per candidate
        max_c = max(len(items[i].continuations) for i in idx)
        slot = torch.tensor([r * max_c + o for r, p in enumerate(packs) for o in p[5]])
        sums = torch.zeros(len(idx) * max_c, dtype=torch.float64).index_add_(
            0, slot, tok_lp
        )
        counts = torch.bincount(slot, minlength=len(idx) * max_c).clamp(min=1)
        means = (sums / counts).view(len(idx), max_c).numpy()
        for r, i in enumerate(idx):
            out[i] = means[r, : len(items[i].continuations)].copy()
    model.train(was_training)
    return out


def accuracy_of(scores: Sequence[np.ndarray], items: Sequence[Scored]) -> dict:
    """Accuracy, item count, chance and bootstrap 95 % interval."""
    correct = np.array(
        [int(np.argmax(s) == it.label) for s, it in zip(scores, items, strict=True)]
    )
    lo, hi = bootstrap_ci(correct)
    return {
        "accuracy": float(correct.mean()),
        "items": len(items),
        "ci95": [lo, hi],
        "chance": float(np.mean([1 / len(it.continuations) for it in items])),
    }


def fast_cloze_accuracy(
    model: PanguAlpha,
    encoded: Sequence[Scored],
    *,
    fmt: str,
    batch_size: int = 16,
    pad_id: int = 0,
    device: torch.device | str = "cpu",
) -> dict:
    """``eval.cloze.cloze_accuracy``'s result for pre-encoded items."""
    if not encoded:
        raise ValueError("no cloze items to score")
    scores = score_packed(
        model, encoded, batch_size=batch_size, pad_id=pad_id, device=device
    )
    return {**accuracy_of(scores, encoded), "format": fmt}

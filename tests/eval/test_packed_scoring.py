"""The packed cloze scorer computes what its oracle, the per-candidate scorer, does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from aisyn.data.cloze import ClozeItem, build_items
from aisyn.eval.cloze import (
    FORMATS,
    EncodedItem,
    cloze_accuracy,
    encode_items,
    pack_item,
    packed_mask,
    packs,
    score_packed,
    score_per_candidate,
)
from aisyn.model.families import build_model
from aisyn.model.pangu import PanguConfig

MAX_LEN = 64
LONG_AND_SHORT = ClozeItem(
    prefix="昨天我去了北京，今天又去了",
    suffix="。",
    candidates=("上海", "北京", "中华人民共和国首都国际机场"),
    answer="北京",
)


@pytest.fixture(scope="module")
def items(news_corpus):
    return build_items(news_corpus, "test", per_document=2, max_documents=20)


@pytest.fixture(scope="module")
def model():
    """Random, but with scores far from uniform (init_std 0.2, not 0.02)."""
    cfg = PanguConfig(
        vocab_size=8000,
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        ffn_size=64,
        seq_len=MAX_LEN,
        init_std=0.2,
    )
    return build_model(cfg, seed=3).eval()


class Unpackable(nn.Module):
    """Stands in for a split run's ``SplitModel``: ``hidden`` and ``logits`` like
    a ``PanguAlpha``, but it is not one, so it must be scored per candidate."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def hidden(self, tokens, attn_mask=None, position_ids=None):
        assert attn_mask is None and position_ids is None, "was given a packed row"
        return self.inner.hidden(tokens)

    def logits(self, x):
        return self.inner.logits(x)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_scores_equal_per_candidate_scores(items, tokenizer, model, fmt):
    # Prepare
    encoded = encode_items(items, tokenizer, MAX_LEN, fmt)
    # Execute
    expected = score_per_candidate(
        model, encoded, batch_size=7, pad_id=tokenizer.pad_id
    )
    packed = score_packed(model, encoded, batch_size=5, pad_id=tokenizer.pad_id)
    # Assert
    assert len(packed) == len(items) > 10
    assert max(float(np.ptp(s)) for s in expected) > 1  # not constant scores
    for e, p in zip(expected, packed, strict=True):
        np.testing.assert_allclose(p, e, rtol=0, atol=1e-5)
    if fmt == "lm":  # rows longer than seq_len were scored too
        assert max(len(pack_item(e).tokens) for e in encoded) > MAX_LEN


@pytest.mark.parametrize("fmt", FORMATS)
def test_accuracy_is_the_per_candidate_accuracy(items, tokenizer, model, fmt):
    assert packs(model) and not packs(Unpackable(model))

    packed = cloze_accuracy(model, items, tokenizer, fmt=fmt, max_len=MAX_LEN)
    oracle = cloze_accuracy(
        Unpackable(model), items, tokenizer, fmt=fmt, max_len=MAX_LEN
    )

    assert packed == oracle
    assert packed["items"] == len(items) and packed["format"] == fmt


def test_packed_scores_do_not_depend_on_the_batch(items, tokenizer, model):
    encoded = encode_items(items[:6], tokenizer, MAX_LEN, "lm")

    together = score_packed(model, encoded, batch_size=16)
    alone = [score_packed(model, [e], batch_size=1)[0] for e in encoded]

    for a, b in zip(together, alone, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_pack_item_layout():
    item = EncodedItem(
        context=[1, 2, 3], continuations=[[4, 5], [6], [7, 8, 9]], label=0
    )

    p = pack_item(item)

    # each candidate but its last token after the context; a 1-token one adds none
    assert p.tokens.tolist() == [1, 2, 3, 4, 7, 8]
    assert p.segment.tolist() == [0, 0, 0, 1, 3, 3]
    assert p.positions.tolist() == [0, 1, 2, 3, 3, 4]  # restart after the context
    assert p.targets.tolist() == [4, 5, 6, 7, 8, 9]
    assert p.candidate.tolist() == [0, 0, 1, 2, 2, 2]
    # first tokens from the context's last column, later ones from their own
    assert p.source.tolist() == [2, 3, 2, 2, 4, 5]


def test_packed_mask_shows_the_context_and_the_own_candidate_only():
    segment = torch.tensor([[0, 0, 0, 1, 3, 3, -1]])

    visible = packed_mask(segment)[0, 0]

    assert visible[5].tolist() == [True, True, True, False, True, True, False]
    assert visible[3].tolist() == [True, True, True, True, False, False, False]
    assert visible[2].tolist() == [True, True, True, False, False, False, False]


def test_packed_uniform_model_does_not_favour_short_candidates(tokenizer, model):
    uniform = build_model(model.config, seed=0).eval()
    with torch.no_grad():
        for p in uniform.parameters():
            p.zero_()  # all logits 0: every token has probability 1 / vocab
    item = encode_items([LONG_AND_SHORT], tokenizer, MAX_LEN)[0]
    lengths = [len(c) for c in item.continuations]
    assert max(lengths) >= 3 * min(lengths)

    scores = score_packed(uniform, [item])[0]

    np.testing.assert_allclose(scores, -np.log(model.config.vocab_size), rtol=1e-6)


def test_scoring_leaves_the_training_mode_as_it_was(items, tokenizer, model):
    model.train()
    try:
        cloze_accuracy(model, items[:2], tokenizer, max_len=MAX_LEN)
        assert model.training
    finally:
        model.eval()


def test_a_packed_row_may_be_longer_than_seq_len_but_not_its_positions(model):
    tokens = torch.zeros(1, MAX_LEN + 8, dtype=torch.long)
    restarting = (torch.arange(MAX_LEN + 8) % MAX_LEN).unsqueeze(0)

    assert model.hidden(tokens, None, restarting).shape[1] == MAX_LEN + 8
    with pytest.raises(ValueError, match="exceeds the model's seq_len"):
        model.hidden(tokens)
    with pytest.raises(ValueError, match="exceeds the model's seq_len"):
        model.hidden(tokens, None, torch.arange(MAX_LEN + 8).unsqueeze(0))

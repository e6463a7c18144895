"""The packed cloze scorer computes exactly what the per-candidate scorer does."""

from __future__ import annotations

import numpy as np
import pytest

from aisyn.data.cloze import build_items
from aisyn.eval.cloze import cloze_accuracy, score_items
from aisyn.experiments.scoring import encode_items, fast_cloze_accuracy, score_packed
from aisyn.model.pangu import PanguConfig, build_model


@pytest.fixture(scope="module")
def items(news_corpus):
    return build_items(news_corpus, "test", per_document=2, max_documents=20)


@pytest.mark.parametrize("fmt", ["lm", "prompt"])
def test_packed_scores_equal_per_candidate_scores(items, tokenizer, fmt):
    # Prepare: a random model whose scores are far from uniform
    model = build_model(
        PanguConfig(
            vocab_size=8000,
            hidden_size=32,
            num_layers=3,
            num_heads=4,
            ffn_size=64,
            seq_len=64,
            init_std=0.5,
        ),
        seed=3,
    ).eval()
    encoded = encode_items(items, tokenizer, 64, fmt)
    # Execute
    expected = score_items(model, encoded, batch_size=7, pad_id=tokenizer.pad_id)
    packed = score_packed(model, encoded, batch_size=5, pad_id=tokenizer.pad_id)
    # Assert
    assert len(packed) == len(items) > 10
    spread = max(float(np.ptp(s)) for s in expected)
    assert spread > 0.1  # the comparison is not between constant scores
    for e, p in zip(expected, packed, strict=True):
        np.testing.assert_allclose(p, e, rtol=0, atol=2e-4)
    fast = fast_cloze_accuracy(model, encoded, fmt=fmt, pad_id=tokenizer.pad_id)
    slow = cloze_accuracy(model, items, tokenizer, fmt=fmt, max_len=64)
    assert fast["accuracy"] == slow["accuracy"] and fast["items"] == slow["items"]
    assert fast["ci95"] == slow["ci95"]

"""Scenario 4's IID partition: every item lands in exactly one part, mixed domains."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from aisyn.data.sft import SFTData
from aisyn.fl.partition import partition_iid


def test_iid_parts_cover_the_pooled_items_once_each(sft_dirs, tmp_path):
    # Prepare
    news = SFTData.open(sft_dirs["news"])
    reviews = SFTData.open(sft_dirs["reviews"])
    # Execute
    parts = partition_iid([sft_dirs["news"], sft_dirs["reviews"]], tmp_path / "iid", 2)
    # Assert: sizes add up, rows are exactly the pooled rows, domains are mixed
    loaded = [SFTData.open(p) for p in parts]
    assert sum(len(p) for p in loaded) == len(news) + len(reviews)
    assert abs(len(loaded[0]) - len(loaded[1])) <= 1
    pooled = Counter(
        tuple(r.tolist()) for r in torch.cat([news.tokens, reviews.tokens])
    )
    got = Counter(tuple(r.tolist()) for p in loaded for r in p.tokens)
    assert got == pooled  # as multisets: the corpora repeat a few items
    news_rows = {tuple(r.tolist()) for r in news.tokens}
    for p in loaded:
        share = sum(tuple(r.tolist()) in news_rows for r in p.tokens) / len(p)
        expected = len(news) / (len(news) + len(reviews))
        assert abs(share - expected) < 0.1
    assert len(loaded[0].test_items()) == len(news.test_items()) + len(
        reviews.test_items()
    )
    with pytest.raises(FileExistsError):
        partition_iid([sft_dirs["news"]], tmp_path / "iid", 2)

"""The privacy tests' public base: a small model trained on both domains."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def reviews_data(tmp_path_factory, tokenizer):
    from aisyn.data.corpora import load_corpus
    from aisyn.data.shards import prepare

    out = tmp_path_factory.mktemp("data") / "reviews"
    prepare(
        load_corpus("reviews"),
        tokenizer,
        32,
        out,
        max_documents=400,
        corpus_specs=["reviews"],
    )
    return out


@pytest.fixture(scope="session")
def base(tmp_path_factory, news_data, reviews_data):
    """A small model trained a few steps on both domains (the public base)."""
    from aisyn.model.pangu import PanguConfig
    from aisyn.train.config import TrainConfig
    from aisyn.train.pretrain import train

    cfg = PanguConfig(
        vocab_size=8000,
        hidden_size=32,
        num_layers=4,
        num_heads=4,
        ffn_size=64,
        seq_len=32,
    )
    out = tmp_path_factory.mktemp("base") / "run"
    tc = TrainConfig(
        steps=10,
        batch_size=8,
        micro_batch_size=8,
        lr=3e-3,
        warmup_steps=2,
        device="cpu",
        seed=3,
    )
    train(cfg, [news_data, reviews_data], out, tc, progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_inverter():
    """B's sequence inverter and known-plaintext bound at their smallest: the
    audit's pieces run, in a second or so (the ci preset's)."""
    from aisyn.privacy.presets import AUDIT_PRESETS

    return AUDIT_PRESETS["ci"].inverter


@pytest.fixture(scope="session")
def news_sft(tmp_path_factory, tokenizer):
    """A's supervised cloze items: 400 news documents, items of up to 32
    tokens (the base's context), with test items for the cloze accuracy."""
    from aisyn.data.corpora import load_corpus
    from aisyn.data.sft import prepare_sft

    out = tmp_path_factory.mktemp("sft") / "news"
    prepare_sft(
        load_corpus("news"),
        tokenizer,
        32,
        out,
        per_document=2,
        test_per_document=1,
        max_documents=400,
        corpus_specs=["news"],
    )
    return out

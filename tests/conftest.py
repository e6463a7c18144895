"""Shared fixtures: small slices of the real corpora, prepared once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n 2` (CI's): the workers share the cores, so each takes one
    # thread, and so do the processes its tests start (they inherit it); two
    # workers of two threads each on two cores spin against each other.
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    from aisyn.data.tokenizer import PanguTokenizer

    return PanguTokenizer.load()


@pytest.fixture(scope="session")
def news_corpus():
    from aisyn.data.corpora import load_corpus

    return load_corpus("news")


@pytest.fixture(scope="session")
def news_data(tmp_path_factory, news_corpus, tokenizer):
    """The first 1500 news documents as shards of 32+1 tokens."""
    from aisyn.data.shards import prepare

    out = tmp_path_factory.mktemp("data") / "news"
    prepare(news_corpus, tokenizer, 32, out, max_documents=1500, corpus_specs=["news"])
    return out


@pytest.fixture(scope="session")
def tiny_config():
    """A model small enough that a training step takes milliseconds."""
    from aisyn.model.pangu import PanguConfig

    return PanguConfig(
        vocab_size=8000,
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        ffn_size=64,
        seq_len=32,
    )


# A two-layer model, for `--model FILE`.
TWO_LAYERS = {
    "vocab_size": 8000,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "ffn_size": 64,
    "seq_len": 32,
}


@pytest.fixture
def model_file(tmp_path):
    """A two-layer model config as a JSON file, for `--model FILE`."""
    import json

    path = tmp_path / "m.json"
    path.write_text(json.dumps(TWO_LAYERS))
    return path


@pytest.fixture(scope="module")
def module_model_file(tmp_path_factory):
    """:func:`model_file` for a module's fixtures (runs several tests read)."""
    import json

    path = tmp_path_factory.mktemp("model") / "m.json"
    path.write_text(json.dumps(TWO_LAYERS))
    return path

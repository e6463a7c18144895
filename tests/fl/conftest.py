"""Fixtures for the federated tests: small corpora, SFT folders, a tiny base model.

The corpora are the first few hundred documents of the real news and reviews
corpora written as plain text files, so building their cloze items tags only
those documents.
"""

from __future__ import annotations

import faulthandler
from collections.abc import Iterator
from pathlib import Path

import pytest
from flower_fakes import task_identity  # noqa: F401  (a fixture for every test here)


@pytest.fixture(autouse=True)
def _watchdog() -> Iterator[None]:
    """Dump all stacks and exit if a test hangs, so the suite always ends."""
    faulthandler.dump_traceback_later(600, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def write_corpus(path: Path, name: str, n: int) -> Path:
    from aisyn.data.corpora import load_corpus

    docs = [d.text.replace("\n", " ") for d in load_corpus(name).documents[:n]]
    path.write_text("\n".join(docs) + "\n", encoding="utf-8")
    return path


def make_base_run(path: Path, config, tokenizer, seed: int = 0) -> Path:
    """A base-model run folder (config.json, tokenizer, checkpoint) without training."""
    from aisyn.model.families import build_model
    from aisyn.train import checkpoint as ckpt
    from aisyn.train.run import RunDir

    run = RunDir(path)
    run.create(
        {"kind": "train", "model": config.to_dict(), "tokenizer": tokenizer.info()},
        resume=False,
    )
    run.copy_tokenizer(tokenizer.path)
    model = build_model(config, seed=seed)
    ckpt.save(run.checkpoints, 0, {ckpt.MODEL_FILE: ckpt.unique_state_dict(model)}, {})
    return path


@pytest.fixture(scope="session")
def fl_config():
    from aisyn.model.pangu import PanguConfig

    return PanguConfig(
        vocab_size=8000,
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        ffn_size=64,
        seq_len=48,
    )


@pytest.fixture(scope="session")
def base_run_factory():
    """``make_base_run`` for tests that need a base of another config (a test
    module cannot import it: ``conftest`` names several modules)."""
    return make_base_run


@pytest.fixture(scope="session")
def base_run(tmp_path_factory, fl_config, tokenizer) -> Path:
    return make_base_run(tmp_path_factory.mktemp("base") / "base", fl_config, tokenizer)


@pytest.fixture(scope="session")
def sft_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """SFT folders of 600 news and 600 reviews documents (2 blanks each, seq 48)."""
    from aisyn.data.corpora import load_corpus
    from aisyn.data.sft import prepare_sft

    root = tmp_path_factory.mktemp("sft")
    out = {}
    for name in ("news", "reviews"):
        corpus_file = write_corpus(root / f"{name}.txt", name, 600)
        out[name] = root / f"sft_{name}"
        prepare_sft(
            load_corpus(corpus_file),
            tokenizer,
            48,
            out[name],
            per_document=2,
            test_per_document=2,
        )
    return out

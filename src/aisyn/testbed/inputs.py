"""The cached inputs of a preset (``testbed.presets``): each domain's token
shards and supervised cloze items, and the base model pretrained on every
domain, or on the preset's public corpora only (our stand-in for pretrained
PanGu-α).

Each is built once, under ``cache_dir``, keyed by everything it is made of
(preset sizes, model, data and tokenizer), so that the comparison
(``aisyn experiment compare``), the privacy audit (``aisyn privacy audit``)
and the benchmarks share them instead of rebuilding them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from aisyn.data.cache import building, cache_dir
from aisyn.data.corpora import load_corpus
from aisyn.data.sft import prepare_sft
from aisyn.data.shards import prepare, read_manifest
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.model.families import config_from_dict
from aisyn.testbed.presets import Preset
from aisyn.train.pretrain import train
from aisyn.train.run import write_json_atomic

log = logging.getLogger("aisyn.experiments")


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _cached_data(
    kind: str, domain: str, key: list, what: str, build: Callable[[Path], object]
) -> Path:
    """The folder of one domain's ``kind`` data keyed by ``key``; ``build``
    writes it there unless it is already (``what``: its log line)."""
    path = cache_dir("experiments", kind) / f"{Path(domain).stem}-{_key(key)}"
    with building(path):
        if not (path / "manifest.json").is_file():
            log.info(what, domain, path)
            build(path)
    return path


def cached_shards(domain: str, tok: PanguTokenizer, preset: Preset) -> Path:
    """Raw-text token shards of one domain (seq_len of the preset)."""
    return _cached_data(
        "shards",
        domain,
        ["shards/1", domain, tok.sha256, preset.seq_len, preset.max_documents],
        "preparing %s token shards in %s",
        lambda path: prepare(
            load_corpus(domain),
            tok,
            preset.seq_len,
            path,
            max_documents=preset.max_documents,
            overwrite=True,
            corpus_specs=[domain],
        ),
    )


def cached_sft(domain: str, tok: PanguTokenizer, preset: Preset) -> Path:
    """Supervised cloze items of one domain's documents (``prepare_sft``)."""
    return _cached_data(
        "sft",
        domain,
        [
            "sft/2",
            domain,
            tok.sha256,
            preset.seq_len,
            preset.per_document,
            preset.test_per_document,
            preset.max_documents,
            preset.seed,
            # (absent where it is the default: the cached folders keep their keys)
            *([] if preset.supervise == "answer" else [preset.supervise]),
        ],
        "building %s supervised cloze items in %s",
        lambda path: prepare_sft(
            load_corpus(domain),
            tok,
            preset.seq_len,
            path,
            per_document=preset.per_document,
            test_per_document=preset.test_per_document,
            seed=preset.seed,
            max_documents=preset.max_documents,
            supervise=preset.supervise,
            corpus_specs=[domain],
            overwrite=True,
        ),
    )


def cached_base(
    preset: Preset, shards: Sequence[Path], tok: PanguTokenizer, device: str
) -> Path:
    """The base model pretrained on the raw train text of ``shards`` (every
    domain's, or a preset's public corpora); built once.

    An interrupted build resumes from its last checkpoint.
    """
    mcfg = config_from_dict(
        {**preset.model, "vocab_size": tok.vocab_size, "seq_len": preset.seq_len}
    )
    cfg = preset.pretrain_config()
    data_hashes = [
        [s["sha256"] for s in read_manifest(d)["splits"]["train"]["shards"]]
        for d in shards
    ]
    key = _key(["base/1", mcfg.to_dict(), cfg.to_dict(), data_hashes, tok.sha256])
    path = cache_dir("base_models") / f"{preset.name}-{key}"
    done = path / "base.json"
    with building(path):
        if done.is_file():
            return path
        log.info("pretraining the base model (%d steps) in %s", cfg.steps, path)
        cfg.ckpt_every = max(1, cfg.steps // 10)
        cfg.device = device
        summary = train(
            mcfg,
            [str(d) for d in shards],
            path,
            cfg,
            resume=(path / "config.json").is_file(),
            progress=False,
        )
        write_json_atomic(done, summary)
    return path

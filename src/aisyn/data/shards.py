"""Memory-mapped token shards: ``aisyn prepare`` writes them, training reads them.

Like the reference's data-processing step, each split's documents are tokenised,
joined with an EOD token after every document, and cut into fixed-length
samples of ``seq_len + 1`` tokens (inputs are ``sample[:-1]``, targets
``sample[1:]``); the last partial sample is dropped. Samples are stored as raw
little-endian ``uint16`` (``uint32`` for vocabularies over 65 535) in shard files
of at most ``SHARD_SAMPLES`` samples, next to a ``manifest.json`` that records
the tokenizer's hash, ``seq_len``, counts, per-shard SHA-256 and the split
rule, so that data made with another tokenizer or length is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from aisyn.data import folder
from aisyn.data.corpora import SPLIT_RULE, SPLITS, Corpus
from aisyn.data.folder import (
    TOKENIZER_FILE,
    PreparedSplit,
    file_sha256,
    finish_folder,
    start_folder,
)
from aisyn.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

FORMAT = "aisyn-shards/1"
SHARD_SAMPLES = 65536


class ShardError(ValueError):
    """Shards are missing, corrupt, or incompatible with the model/tokenizer."""


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def pack(docs_ids: Sequence[Sequence[int]], eod_id: int, sample_len: int) -> np.ndarray:
    """Concatenate documents with EOD after each; cut into (N, sample_len) rows."""
    eod = np.array([eod_id], dtype=np.int64)
    pieces = [p for d in docs_ids for p in (np.asarray(d, dtype=np.int64), eod)]
    flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    n = len(flat) // sample_len
    return flat[: n * sample_len].reshape(n, sample_len)


def prepare(
    corpus: Corpus,
    tokenizer: Tokenizer,
    seq_len: int,
    out_dir: str | Path,
    *,
    max_documents: int | None = None,
    overwrite: bool = False,
    corpus_specs: Sequence[str] | None = None,
) -> dict:
    """Tokenise ``corpus`` into train/valid/test shards under ``out_dir``.

    ``max_documents`` keeps the first N documents (a quick slice for demos).
    Refuses to touch an existing non-empty folder unless ``overwrite``; the new
    folder is built beside it and swapped in only when complete.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    docs = list(corpus.documents[:max_documents] if max_documents else corpus.documents)
    if not docs:
        raise ShardError(f"corpus {corpus.name!r} has no documents")
    ids = tokenizer.encode_many([d.text for d in docs])
    dtype = _dtype_for(tokenizer.vocab_size)
    out, tmp = start_folder(out_dir, overwrite)
    manifest: dict = {
        "format": FORMAT,
        "seq_len": seq_len,
        "sample_len": seq_len + 1,
        "dtype": dtype.str,
        "tokenizer": {**tokenizer.info(), "file": TOKENIZER_FILE},
        "corpus": corpus.name,
        # How to reload the documents (e.g. to build cloze items for evaluation).
        "corpus_specs": [str(c) for c in corpus_specs or []],
        "sources": list(corpus.sources),
        "max_documents": max_documents,
        "split_rule": SPLIT_RULE,
        "splits": {},
    }
    for split in SPLITS:
        split_ids = [i for d, i in zip(docs, ids, strict=True) if d.split == split]
        samples = pack(split_ids, tokenizer.eod_id, seq_len + 1).astype(dtype)
        shards = []
        for k, start in enumerate(range(0, len(samples), SHARD_SAMPLES)):
            name = f"{split}-{k:05d}.bin"
            chunk = np.ascontiguousarray(samples[start : start + SHARD_SAMPLES])
            chunk.tofile(tmp / name)
            shards.append(
                {"file": name, "samples": len(chunk), "sha256": file_sha256(tmp / name)}
            )
        manifest["splits"][split] = {
            "documents": len(split_ids),
            "tokens": int(sum(len(i) + 1 for i in split_ids)),
            "samples": len(samples),
            "shards": shards,
        }
        log.info(
            "%s: %d documents -> %d samples of %d tokens",
            split,
            len(split_ids),
            len(samples),
            seq_len + 1,
        )
    finish_folder(tmp, out, manifest, Path(tokenizer.path))
    return manifest


def read_manifest(data_dir: str | Path) -> dict:
    return folder.read_manifest(data_dir, FORMAT, ShardError, "prepare")


@dataclass
class TokenShards(PreparedSplit):
    """The samples of one split, memory-mapped; ``ds[i]`` is an int64 tensor."""

    arrays: list[np.ndarray]

    FORMAT = FORMAT
    ERROR = ShardError
    COMMAND = "prepare"

    @classmethod
    def _open(
        cls,
        data_dir: Path,
        m: dict,
        split: str,
        tokenizer_sha256: str | None,
        seq_len: int | None,
        verify: bool,
    ) -> TokenShards:
        if split not in m["splits"]:
            raise ShardError(f"{data_dir}: no {split!r} split in manifest")
        # What re-making the folder takes: its own corpus, the other settings.
        redo = f"aisyn prepare --corpus {m.get('corpus', 'CORPUS')} --out NEW_DIR"
        if tokenizer_sha256 and m["tokenizer"]["sha256"] != tokenizer_sha256:
            raise ShardError(
                f"{data_dir}: shards were made with tokenizer "
                f"{m['tokenizer']['sha256'][:12]}, not {tokenizer_sha256[:12]} (the "
                f"model's); re-run `{redo} --seq-len {m['seq_len']} --tokenizer T` "
                "with T the model's tokenizer (its run folder's tokenizer file)"
            )
        if seq_len is not None and m["seq_len"] != seq_len:
            raise ShardError(
                f"{data_dir}: shards have seq_len {m['seq_len']}, expected {seq_len}; "
                f"re-run `{redo} --seq-len {seq_len}` with the tokenizer they were "
                "made with"
            )
        dtype = np.dtype(m["dtype"])
        if dtype not in (np.dtype("<u2"), np.dtype("<u4")):
            raise ShardError(f"{data_dir}: shard dtype {dtype} is not prepare's")
        arrays = []
        for shard in m["splits"][split]["shards"]:
            name = shard["file"]
            if not isinstance(name, str) or Path(name).name != name:
                # the manifest names files in its folder, no paths
                raise ShardError(f"{data_dir}: shard {name!r:.60} is not a file name")
            path = data_dir / name
            if not path.is_file():
                raise ShardError(f"{path}: shard file missing")
            expect = shard["samples"] * m["sample_len"] * dtype.itemsize
            if path.stat().st_size != expect:
                raise ShardError(
                    f"{path}: corrupt shard: {path.stat().st_size} bytes, "
                    f"manifest says {expect}"
                )
            if verify and file_sha256(path) != shard["sha256"]:
                raise ShardError(f"{path}: corrupt shard: SHA-256 does not match")
            arrays.append(
                np.memmap(
                    path,
                    dtype=dtype,
                    mode="r",
                    shape=(shard["samples"], m["sample_len"]),
                )
            )
        return cls(data_dir, split, m, arrays)

    def __len__(self) -> int:
        return sum(len(a) for a in self.arrays)

    def batch(self, indices: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Rows ``indices`` as one (len(indices), seq_len+1) int64 tensor."""
        idx = np.asarray(indices, dtype=np.int64)
        if len(self.arrays) == 1:
            rows = self.arrays[0][idx]
        else:
            offsets = np.cumsum([0] + [len(a) for a in self.arrays])
            shard = np.searchsorted(offsets, idx, side="right") - 1
            rows = np.stack(
                [
                    self.arrays[s][i - offsets[s]]
                    for s, i in zip(shard, idx, strict=True)
                ]
            )
        return torch.from_numpy(rows.astype(np.int64))

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.batch([i])[0]


def open_many(
    data_dirs: Sequence[str | Path], split: str = "train", **kw
) -> list[TokenShards]:
    """Open several data folders and check they agree on tokenizer and seq_len."""
    if not data_dirs:
        raise ShardError("no --data folder given")
    first = TokenShards.open(data_dirs[0], split, **kw)
    rest = [
        TokenShards.open(
            d,
            split,
            tokenizer_sha256=first.tokenizer_info["sha256"],
            seq_len=first.seq_len,
            verify=kw.get("verify", True),
        )
        for d in data_dirs[1:]
    ]
    return [first, *rest]

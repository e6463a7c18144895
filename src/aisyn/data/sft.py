"""Supervised cloze data for fine-tuning: tokenised prompt + answer, loss on the answer.

Each cloze item becomes one sequence in exactly the format ``aisyn eval`` scores
fine-tuned models with (``eval.cloze``'s ``prompt`` format)::

    <eod> prompt_text(item) | answer tokens <eod>
    \\_____ context ______/   \\_ supervised _/

The loss covers the answer's tokens and the closing ``<eod>`` (the tokens the
``prompt`` scorer averages over), nothing else. ``aisyn prepare-sft`` writes a
folder per domain::

    manifest.json        format, tokenizer hash, seq_len, counts, file hashes
    train.safetensors    tokens (N, seq_len+1) int32 padded with <pad>,
    valid.safetensors    answer_start (N,), length (N,)
    test.jsonl           cloze items of the test documents (for accuracy)
    tokenizer.model      the tokenizer the tokens were made with

Tensors are safetensors (never pickle); data made with another tokenizer or
sequence length is refused when opened.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from aisyn.data.cloze import (
    ClozeItem,
    build_items,
    domain_nouns,
    prompt_text,
    read_items,
)
from aisyn.data.corpora import Corpus
from aisyn.data.folder import (
    TOKENIZER_FILE,
    PreparedSplit,
    file_sha256,
    finish_folder,
    start_folder,
)
from aisyn.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

FORMAT = "aisyn-sft/2"  # 2: prompt_text puts the blank's left context last
TEST_ITEMS = "test.jsonl"
IGNORE = -100  # target value the loss skips (``lm_loss``'s ignore_index)
#: what an item's loss covers: its answer (completion-only, the usual SFT), or
#: the whole item, passage and answer (a prompt loss weight of 1)
SUPERVISE = ("answer", "item")
# Characters kept free of the passage budget, as the prompt scorer does.
_MARGIN = 8


class SFTError(ValueError):
    """SFT data is missing, corrupt, or made with another tokenizer/length."""


def encode_item(item: ClozeItem, tok: Tokenizer, seq_len: int) -> tuple[list[int], int]:
    """(token ids, index of the first supervised token) for one item.

    The sequence holds at most ``seq_len + 1`` tokens (inputs are ``ids[:-1]``);
    the passage is trimmed around the blank first, then the context from the
    left, as the ``prompt`` scorer does.
    """
    answer = [*tok.encode(item.answer), tok.eod_id]
    if len(answer) > seq_len // 2:
        answer = [*answer[: seq_len // 2 - 1], tok.eod_id]
    budget = seq_len + 1 - len(answer)
    context = [tok.eod_id, *tok.encode(prompt_text(item, budget - _MARGIN))]
    if len(context) > budget:
        context = context[len(context) - budget :]
    return context + answer, len(context)


def encode_items(
    items: Sequence[ClozeItem], tok: Tokenizer, seq_len: int
) -> dict[str, torch.Tensor]:
    """Tensors of many items: tokens (N, seq_len+1), answer_start (N,), length (N,)."""
    n = len(items)
    tokens = np.full((n, seq_len + 1), tok.pad_id, dtype=np.int32)
    starts = np.zeros(n, dtype=np.int32)
    lengths = np.zeros(n, dtype=np.int32)
    for i, item in enumerate(tqdm(items, desc="tokenising", unit="item", disable=None)):
        ids, start = encode_item(item, tok, seq_len)
        tokens[i, : len(ids)] = ids
        starts[i], lengths[i] = start, len(ids)
    return {
        "tokens": torch.from_numpy(tokens),
        "answer_start": torch.from_numpy(starts),
        "length": torch.from_numpy(lengths),
    }


def targets_for(
    tokens: torch.Tensor, answer_start: torch.Tensor, length: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for a batch, cut to its longest sequence.

    ``targets[i, j]`` is the token at ``j + 1`` when that position is supervised
    (``answer_start <= j + 1 < length``), else ``IGNORE``.
    """
    T = int(length.max())
    tokens = tokens[:, :T].to(torch.int64)
    pos = torch.arange(1, T, device=tokens.device)
    keep = (pos >= answer_start[:, None]) & (pos < length[:, None])
    targets = torch.where(keep, tokens[:, 1:], IGNORE)
    return tokens[:, :-1], targets


def prepare_sft(
    corpus: Corpus,
    tok: Tokenizer,
    seq_len: int,
    out_dir: str | Path,
    *,
    per_document: int = 5,
    test_per_document: int = 5,
    seed: int = 0,
    max_documents: int | None = None,
    supervise: str = "answer",
    corpus_specs: Sequence[str] | None = None,
    overwrite: bool = False,
) -> dict:
    """Build cloze items from ``corpus`` and write the SFT folder; returns its manifest.

    Train/valid items come from the corpus's train/valid documents, test items
    (kept as plain cloze items) from its test documents. ``supervise``: the
    tokens the loss covers (``SUPERVISE``; "item" starts every item's
    supervised span at its first token). The folder is built beside
    ``out_dir`` and swapped in only when complete.
    """
    if seq_len < 8:
        raise ValueError(f"seq_len must be >= 8, got {seq_len}")
    if supervise not in SUPERVISE:
        raise ValueError(
            f"--supervise must be one of {', '.join(SUPERVISE)}, got {supervise!r}"
        )
    out, tmp = start_folder(out_dir, overwrite)
    manifest: dict = {
        "format": FORMAT,
        "seq_len": seq_len,
        "sample_len": seq_len + 1,
        "tokenizer": {**tok.info(), "file": TOKENIZER_FILE},
        "corpus": corpus.name,
        "corpus_specs": [str(c) for c in corpus_specs or []],
        "sources": list(corpus.sources),
        "per_document": per_document,
        "test_per_document": test_per_document,
        "seed": seed,
        "max_documents": max_documents,
        "supervise": supervise,
        "splits": {},
    }
    padding = domain_nouns(corpus)  # once, not once per split

    def items_of(split: str, per_document: int) -> list[ClozeItem]:
        return build_items(
            corpus,
            split,
            per_document=per_document,
            seed=seed,
            max_documents=max_documents,
            padding=padding,
        )

    for split in ("train", "valid"):
        items = items_of(split, per_document)
        if not items:
            raise SFTError(f"corpus {corpus.name!r}: no cloze items in {split} split")
        tensors = encode_items(items, tok, seq_len)
        if supervise == "item":  # every token after the leading EOD
            tensors["answer_start"].fill_(1)
        save_file(tensors, str(tmp / f"{split}.safetensors"))
        manifest["splits"][split] = {
            "items": len(items),
            "answer_tokens": int((tensors["length"] - tensors["answer_start"]).sum()),
            "file": f"{split}.safetensors",
            "sha256": file_sha256(tmp / f"{split}.safetensors"),
        }
        log.info("%s: %d supervised cloze items", split, len(items))
    test = items_of("test", test_per_document)
    (tmp / TEST_ITEMS).write_text(
        "".join(it.to_json() + "\n" for it in test), encoding="utf-8"
    )
    manifest["splits"]["test"] = {"items": len(test), "file": TEST_ITEMS}
    finish_folder(tmp, out, manifest, Path(tok.path))
    return manifest


@dataclass
class SFTData(PreparedSplit):
    """One split of an SFT folder, in memory (a few MB per domain)."""

    tokens: torch.Tensor  # (N, seq_len+1) int32
    answer_start: torch.Tensor  # (N,) int32
    length: torch.Tensor  # (N,) int32

    FORMAT = FORMAT
    ERROR = SFTError
    COMMAND = "prepare-sft"

    @classmethod
    def _open(
        cls,
        data_dir: Path,
        m: dict,
        split: str,
        tokenizer_sha256: str | None,
        seq_len: int | None,
        verify: bool,
    ) -> SFTData:
        info = m["splits"].get(split)
        if info is None or "sha256" not in info:
            raise SFTError(f"{data_dir}: no {split!r} split of supervised items")
        if tokenizer_sha256 and m["tokenizer"]["sha256"] != tokenizer_sha256:
            raise SFTError(
                f"{data_dir}: prepared with tokenizer {m['tokenizer']['sha256'][:12]}, "
                f"but the model uses {tokenizer_sha256[:12]}; re-run `aisyn "
                "prepare-sft` with the model's tokenizer"
            )
        if seq_len is not None and m["seq_len"] > seq_len:
            raise SFTError(
                f"{data_dir}: sequences of {m['seq_len']} tokens exceed the model's "
                f"seq_len {seq_len}; re-run `aisyn prepare-sft --seq-len {seq_len}`"
            )
        path = data_dir / info["file"]
        if not path.is_file():
            raise SFTError(f"{path}: missing")
        if verify and file_sha256(path) != info["sha256"]:
            raise SFTError(f"{path}: corrupt: SHA-256 does not match the manifest")
        try:
            t = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise SFTError(f"{path}: corrupt safetensors file ({e})") from None
        expected = {"tokens", "answer_start", "length"}
        if set(t) != expected or t["tokens"].shape[1] != m["sample_len"]:
            raise SFTError(f"{path}: unexpected tensors {sorted(t)}")
        n = len(t["tokens"])
        if not (
            len(t["answer_start"]) == len(t["length"]) == n
            and bool((t["answer_start"] >= 1).all())
            and bool((t["answer_start"] < t["length"]).all())
            and bool((t["length"] <= m["sample_len"]).all())
        ):
            raise SFTError(f"{path}: inconsistent answer offsets")
        return cls(data_dir, split, m, t["tokens"], t["answer_start"], t["length"])

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, indices: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, ...]:
        """(inputs, targets) of rows ``indices``, cut to their longest sequence."""
        idx = torch.as_tensor(indices, dtype=torch.int64)
        return targets_for(self.tokens[idx], self.answer_start[idx], self.length[idx])

    def test_items(self) -> list[ClozeItem]:
        """The cloze items of the domain's test documents."""
        return read_items(self.data_dir / TEST_ITEMS)


def open_sft_many(
    data_dirs: Sequence[str | Path], split: str = "train", **kw
) -> list[SFTData]:
    """Open several SFT folders and check they share tokenizer and length."""
    if not data_dirs:
        raise SFTError("no SFT data folder given")
    first = SFTData.open(data_dirs[0], split, **kw)
    rest = []
    for d in data_dirs[1:]:
        other = SFTData.open(d, split, **kw)
        if other.tokenizer_info["sha256"] != first.tokenizer_info["sha256"]:
            raise SFTError(f"{d}: prepared with another tokenizer than {data_dirs[0]}")
        if other.seq_len != first.seq_len:
            raise SFTError(
                f"{d}: seq_len {other.seq_len} differs from {data_dirs[0]}'s "
                f"{first.seq_len}; prepare both with the same --seq-len"
            )
        rest.append(other)
    return [first, *rest]


def cat_batches(
    sources: Sequence[SFTData], indices: torch.Tensor, offsets: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for global indices over several sources (pooled data)."""
    idx = indices.numpy()
    src = np.searchsorted(offsets, idx, side="right") - 1
    if len(sources) == 1:
        return sources[0].batch(indices)
    rows = torch.empty(len(idx), sources[0].tokens.shape[1], dtype=torch.int32)
    starts = torch.empty(len(idx), dtype=torch.int32)
    lengths = torch.empty(len(idx), dtype=torch.int32)
    for s in np.unique(src):
        sel = torch.from_numpy(np.nonzero(src == s)[0])
        local = torch.from_numpy(idx[sel.numpy()] - offsets[s])
        rows[sel] = sources[s].tokens[local]
        starts[sel] = sources[s].answer_start[local]
        lengths[sel] = sources[s].length[local]
    return targets_for(rows, starts, lengths)

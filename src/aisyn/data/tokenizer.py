"""The PanGu-α tokenizer recipe: jieba pre-segmentation + SentencePiece.

PanGu first cuts text into words with jieba, maps the text's own spaces and
newlines to ``▂`` and ``▃`` (so they survive as ordinary symbols), joins the
words with spaces and hands that to SentencePiece, whose ``▁`` word boundaries
then fall on jieba's word boundaries. Decoding drops the joining spaces and maps
``▂``/``▃`` back. Our trained models use identity normalisation and byte
fallback so the round trip text -> ids -> text is lossless (the one exception:
literal ``▂``/``▃`` in the input come back as space/newline, as in PanGu).

jieba is the slow part (~15 s over both corpora), so segmented documents are
cached on disk, keyed by the text they came from.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path

import sentencepiece as spm

from aisyn.data.cache import cache_dir

log = logging.getLogger(__name__)

SPACE, NEWLINE = "\u2582", "\u2583"
_TO_SYMBOLS = str.maketrans({" ": SPACE, "\n": NEWLINE})
EOD_PIECE, PAD_PIECE = "<eod>", "<pad>"
DEFAULT_TOKENIZER = "zh8k"  # shipped in aisyn/assets, trained on news + reviews


def _jieba():
    import jieba

    jieba.setLogLevel(logging.WARNING)
    return jieba


def segment(text: str) -> str:
    """jieba words joined by spaces, with the text's own whitespace as ▂/▃."""
    return " ".join(w.translate(_TO_SYMBOLS) for w in _jieba().cut(text))


def segment_many(texts: Sequence[str], cache: bool = True) -> list[str]:
    """``segment`` over many documents, memoised on disk by content hash."""
    if not texts:
        return []
    import jieba

    key = hashlib.sha256()
    key.update(f"jieba={jieba.__version__};recipe=1\0".encode())
    for t in texts:
        key.update(t.encode("utf-8"))
        key.update(b"\0")
    path = cache_dir("segmented") / f"{key.hexdigest()[:32]}.txt"
    if cache and path.is_file():
        lines = path.read_text(encoding="utf-8").split("\n")
        if len(lines) == len(texts):
            return lines
        log.warning("%s: stale segmentation cache, rebuilding", path)
    # Segmented text never holds "\n" (it is mapped to ▃), so one doc per line.
    out = [segment(t) for t in texts]
    if cache:
        _atomic_write_text(path, "\n".join(out))
    return out


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class TokenizerError(ValueError):
    """A tokenizer file is missing, corrupt, or not the one data was made with."""


class PanguTokenizer:
    """A SentencePiece model applied the PanGu way (see module docstring)."""

    def __init__(self, model_file: str | Path) -> None:
        path = Path(model_file)
        if not path.is_file():
            raise TokenizerError(f"{path}: tokenizer model not found")
        self.model_bytes = path.read_bytes()
        self.path = path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(self.model_bytes)
        except (RuntimeError, OSError) as e:
            raise TokenizerError(
                f"{path}: not a SentencePiece model ({e})".splitlines()[0]
            ) from None
        self.sha256 = hashlib.sha256(self.model_bytes).hexdigest()
        # PanGu's vocab.model has <eod>; fall back to </s> for other models.
        eod = self.sp.piece_to_id(EOD_PIECE)
        if eod == self.sp.unk_id() and EOD_PIECE != self.sp.id_to_piece(eod):
            eod = self.sp.eos_id()
        if eod < 0:
            raise TokenizerError(f"{path}: model has neither <eod> nor </s>")
        self.eod_id = eod
        pad = self.sp.piece_to_id(PAD_PIECE)
        self.pad_id = pad if self.sp.id_to_piece(pad) == PAD_PIECE else eod

    @classmethod
    def load(cls, name_or_path: str | Path | None = None) -> PanguTokenizer:
        """A shipped tokenizer by name (default ``zh8k``) or a ``.model`` file."""
        name = str(name_or_path or DEFAULT_TOKENIZER)
        if "/" not in name and not name.endswith(".model"):
            asset = resources.files("aisyn") / "assets" / f"tokenizer_{name}.model"
            if not asset.is_file():
                raise TokenizerError(f"no shipped tokenizer named {name!r}")
            return cls(Path(str(asset)))
        return cls(name)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def info(self) -> dict:
        return {
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
            "pad_id": self.pad_id,
        }

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(segment(text))

    def encode_segmented(self, segmented: Sequence[str]) -> list[list[int]]:
        """Batch-encode already segmented documents (SentencePiece runs threaded)."""
        return self.sp.encode(list(segmented))

    def encode_many(self, texts: Sequence[str], cache: bool = True) -> list[list[int]]:
        return self.encode_segmented(segment_many(texts, cache=cache))

    def decode(self, ids: Iterable[int]) -> str:
        text = self.sp.decode(list(ids))
        return text.replace(" ", "").replace(SPACE, " ").replace(NEWLINE, "\n")


def train_tokenizer(
    texts: Sequence[str],
    vocab_size: int,
    out_file: str | Path,
    *,
    seed_sentences: int = 2_000_000,
) -> PanguTokenizer:
    """Train a SentencePiece unigram model on jieba-segmented ``texts``.

    Identity normalisation and byte fallback keep the round trip lossless;
    ``<eod>`` and ``<pad>`` are control symbols so text can never produce them.
    """
    out = Path(out_file)
    if out.suffix != ".model":
        raise ValueError(f"{out}: tokenizer file name must end in .model")
    if out.exists():
        raise FileExistsError(f"{out}: exists; refusing to overwrite a tokenizer")
    out.parent.mkdir(parents=True, exist_ok=True)
    segmented = segment_many(texts)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(segmented), encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(Path(tmp) / "sp"),
            vocab_size=vocab_size,
            model_type="unigram",
            character_coverage=0.9995,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            max_sentence_length=1 << 16,
            input_sentence_size=seed_sentences,
            shuffle_input_sentence=False,
            control_symbols=[EOD_PIECE, PAD_PIECE],
            bos_id=-1,
            eos_id=-1,
            unk_id=0,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
        data = (Path(tmp) / "sp.model").read_bytes()
    tmp_out = out.with_suffix(".model.tmp")
    tmp_out.write_bytes(data)
    os.replace(tmp_out, out)
    return PanguTokenizer(out)

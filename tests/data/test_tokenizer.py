import pytest

from aisyn.data.corpora import load_corpus
from aisyn.data.tokenizer import (
    PanguTokenizer,
    TokenizerError,
    segment,
    train_tokenizer,
)


def test_round_trip_is_lossless_on_both_corpora(tokenizer, news_corpus):
    reviews = load_corpus("reviews")
    texts = [d.text for d in news_corpus.documents[::40]]
    texts += [d.text for d in reviews.documents[::40]]

    ids = tokenizer.encode_many(texts)

    assert len(texts) > 900
    assert [tokenizer.decode(i) for i in ids] == texts


def test_spaces_and_newlines_survive(tokenizer):
    text = "PanGu  模型\n第二行 有空格\t和制表符"

    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_pangu_recipe_segments_with_jieba():
    seg = segment("我爱北京天安门 你好\n再见")

    assert seg == "我 爱 北京 天安门 \u2582 你好 \u2583 再见"


def test_eod_is_a_control_symbol(tokenizer):
    assert tokenizer.sp.id_to_piece(tokenizer.eod_id) == "<eod>"
    assert tokenizer.eod_id not in tokenizer.encode("<eod> 文本")


def test_train_a_small_tokenizer(tmp_path, news_corpus):
    texts = [d.text for d in news_corpus.documents[:800]]

    tok = train_tokenizer(texts, 3000, tmp_path / "t.model")

    assert tok.vocab_size == 3000
    assert tok.decode(tok.encode(texts[3])) == texts[3]
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        train_tokenizer(texts, 3000, tmp_path / "t.model")


def test_a_vocabulary_too_small_or_large_for_the_corpus_is_one_line(tmp_path):
    """SentencePiece refused with a raw RuntimeError quoting its C++ source."""
    texts = [f"国务院总理今天在北京会见了来访的外国代表团。{i}" for i in range(50)]
    with pytest.raises(TokenizerError, match=r"too small: .* need at least \d+; use"):
        train_tokenizer(texts, 20, tmp_path / "small.model")
    with pytest.raises(TokenizerError, match=r"too large .* at most \d+ pieces"):
        train_tokenizer(texts, 100_000, tmp_path / "large.model")
    assert not list(tmp_path.iterdir())  # nothing written


def test_text_that_is_not_utf8_is_one_line(tokenizer):
    from aisyn.data.tokenizer import check_text

    with pytest.raises(TokenizerError, match=r"not valid UTF-8 text \(byte 0xfe at"):
        tokenizer.encode("ab\udcfe")
    with pytest.raises(TokenizerError, match=r"--prompt .* \(U\+D800 at character 0"):
        check_text("\ud800", "--prompt")
    assert check_text("本报 ok") == "本报 ok"


def test_missing_or_corrupt_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer model not found"):
        PanguTokenizer(tmp_path / "none.model")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"\x00garbage" * 20)
    with pytest.raises(TokenizerError, match="bad.model: not a SentencePiece model"):
        PanguTokenizer(bad)


@pytest.fixture
def jieba_hmm_lengths(monkeypatch):
    """The length of every run jieba's HMM decodes: its time is quadratic in
    that length (the Viterbi path is copied at every character)."""
    from jieba import finalseg

    lengths = []
    viterbi = finalseg.viterbi

    def recording(obs, *args):
        lengths.append(len(obs))
        return viterbi(obs, *args)

    monkeypatch.setattr(finalseg, "viterbi", recording)
    return lengths


def test_jieba_never_decodes_a_run_longer_than_its_bound(jieba_hmm_lengths):
    """A long run of characters jieba has no word for (100 000 "中": 52 s,
    2 000 000 never finished) is segmented in bounded pieces: linear time."""
    from aisyn.data.tokenizer import JIEBA_RUN_CHARS

    text = "前言，" + "中" * 3000 + "。abc" + "x" * 1000 + "后记"
    seg = segment(text)
    assert seg.replace(" ", "") == text
    assert jieba_hmm_lengths and max(jieba_hmm_lengths) <= JIEBA_RUN_CHARS


def test_text_without_long_runs_segments_as_in_one_piece(news_corpus):
    """Cuts fall only inside runs longer than the bound: other text gives the
    words jieba gives for it whole (cached segmentations stay valid)."""
    import jieba

    text = "\n".join(d.text for d in news_corpus.documents[:200])
    assert len(text) > 20_000
    whole = " ".join(w.replace(" ", "▂").replace("\n", "▃") for w in jieba.cut(text))
    assert segment(text) == whole


def test_the_shipped_corpora_are_never_cut():
    """Every document of both corpora is segmented in one piece (the bound
    was 256 once, which cut three news documents: the demo's data changed)."""
    from aisyn.data.corpora import load_corpora
    from aisyn.data.tokenizer import _jieba_pieces

    docs = load_corpora(["news", "reviews"]).documents
    assert len(docs) > 36_000
    assert [d.text for d in docs if len(_jieba_pieces(d.text)) > 1] == []


def test_preparing_one_long_line_reports_progress(
    tmp_path, monkeypatch, caplog, jieba_hmm_lengths
):
    """`aisyn prepare` of a corpus that is one long line (it ran for minutes
    with no output): bounded pieces, and a progress line while it works."""
    from aisyn.cli import main
    from aisyn.data import tokenizer
    from aisyn.data.tokenizer import JIEBA_RUN_CHARS

    monkeypatch.setenv("AISYN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer, "PROGRESS_EVERY_S", 0.0)
    corpus = tmp_path / "long_line.txt"
    corpus.write_text("中" * 5_000 + "\n", encoding="utf-8")
    argv = ["prepare", "--corpus", str(corpus), "--out", str(tmp_path / "out")]
    with caplog.at_level("INFO", logger="aisyn.data.tokenizer"):
        assert main([*argv, "--seq-len", "32"]) == 0
    lines = [r.getMessage() for r in caplog.records]
    progress = [m for m in lines if m.startswith("segmenting with jieba: ")]
    assert progress and "5000 of 5000 characters (100%)" in progress[-1], lines
    assert max(jieba_hmm_lengths) <= JIEBA_RUN_CHARS

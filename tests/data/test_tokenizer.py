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


def test_missing_or_corrupt_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer model not found"):
        PanguTokenizer(tmp_path / "none.model")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"\x00garbage" * 20)
    with pytest.raises(TokenizerError, match="bad.model: not a SentencePiece model"):
        PanguTokenizer(bad)

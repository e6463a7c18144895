import numpy as np
import pytest
import torch
from torch import nn

from aisyn.data.cloze import (
    NUM_CANDIDATES,
    ClozeError,
    ClozeItem,
    build_items,
    items_from_document,
    prompt_text,
    read_items,
    write_items,
)
from aisyn.eval.cloze import cloze_accuracy, encode_item, score_per_candidate


class OracleLM(nn.Module):
    """Predicts a fixed token sequence: after token t it puts all mass on next[t]."""

    def __init__(self, next_token: dict[int, int], vocab: int, seq_len: int = 256):
        super().__init__()
        self.table = torch.full((vocab,), -1, dtype=torch.long)
        for a, b in next_token.items():
            self.table[a] = b
        self.vocab = vocab
        self.config = type("C", (), {"seq_len": seq_len})()

    def hidden(self, tokens):
        return self.table[tokens]  # (B, T) "hidden" = the predicted next token

    def logits(self, h):
        out = torch.zeros(*h.shape, self.vocab)
        known = h >= 0
        out[known] = torch.nn.functional.one_hot(h[known], self.vocab).float() * 30
        return out


class UniformLM(OracleLM):
    def __init__(self, vocab):
        super().__init__({}, vocab)


ITEM = ClozeItem(
    prefix="昨天我去了北京，今天又去了",
    suffix="。",
    candidates=("上海", "北京", "中华人民共和国首都国际机场"),
    answer="北京",
)


def test_forced_answer_is_ranked_first(tokenizer):
    # Make the model deterministically continue the prefix with the answer.
    context = [tokenizer.eod_id, *tokenizer.encode(ITEM.prefix)]
    answer = tokenizer.encode("北京。")
    chain = [*context, *answer]
    oracle = OracleLM(
        dict(zip(chain[:-1], chain[1:], strict=True)), tokenizer.vocab_size
    )

    res = cloze_accuracy(oracle, [ITEM], tokenizer)

    assert res["accuracy"] == 1.0 and res["items"] == 1


def test_mean_per_token_score_does_not_favour_short_candidates(tokenizer):
    enc = encode_item(ITEM, tokenizer, 128)
    lengths = [len(c) for c in enc.continuations]
    assert max(lengths) >= 3 * min(lengths)  # the candidates really differ

    scores = score_per_candidate(UniformLM(tokenizer.vocab_size), [enc])[0]

    # A model indifferent between tokens gives every candidate the same score;
    # a summed log-likelihood would have preferred the shortest by a wide margin.
    assert np.ptp(scores) < 1e-6
    assert scores[0] == pytest.approx(-np.log(tokenizer.vocab_size), rel=1e-5)


def test_real_model_scores_batch_independently(tokenizer, tiny_config):
    from aisyn.model.families import build_model

    model = build_model(tiny_config, seed=0).eval()
    other = ClozeItem("今天天气很好，我们去公园", "吧。", ("散步", "游泳"), "散步")
    encs = [encode_item(i, tokenizer, 32) for i in (ITEM, other)]

    together = score_per_candidate(model, encs, batch_size=16)
    alone = [score_per_candidate(model, [e], batch_size=1)[0] for e in encs]

    for a, b in zip(together, alone, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_items_blank_a_repeated_noun(news_corpus):
    items = build_items(news_corpus, "test", per_document=2, max_documents=120)

    assert len(items) > 30
    for it in items:
        assert len(it.candidates) == NUM_CANDIDATES
        assert it.answer in it.prefix  # a later occurrence was blanked
        assert it.answer in it.candidates


def test_items_are_deterministic_and_several_per_document():
    tagged = tuple(
        (w, "n" if w in {"经济", "发展", "改革"} else "v")
        for w in "经济 发展 看 改革 经济 发展 改革 说".split()
    )

    a = items_from_document(tagged, ["人民", "国家"], max_items=5)
    b = items_from_document(tagged, ["人民", "国家"], max_items=5)

    assert a == b
    assert sorted(i.answer for i in a) == ["发展", "改革", "经济"]
    assert all(len(i.candidates) == 5 for i in a)  # 3 doc nouns + 2 padding


def test_cloze_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "c.jsonl"
    write_items([ITEM], path)

    assert read_items(path) == [ITEM]
    with pytest.raises(FileExistsError):
        write_items([ITEM], path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(ITEM.to_json() + '\n{"prefix": "a", "suffix": "b"}\n')
    with pytest.raises(ClozeError, match=r"bad.jsonl:2: malformed cloze item"):
        read_items(bad)
    bad.write_text(
        '{"prefix": "a", "suffix": "b", "candidates": ["x"], "answer": "y"}\n'
    )
    with pytest.raises(ClozeError, match="answer is not among the candidates"):
        read_items(bad)
    bad.write_text(ITEM.to_json() + "\n" + "[" * 100_000 + "\n")
    with pytest.raises(ClozeError, match=r"bad.jsonl:2: nested deeper than 32"):
        read_items(bad)


def test_prompt_keeps_the_blank_when_truncated():
    item = ClozeItem("甲" * 500, "乙" * 500, ("丙", "丁"), "丙")

    text = prompt_text(item, max_chars=100)

    assert "＿＿" in text and len(text) < 120
    assert text.count("甲") == 50 and text.count("乙") == 50


class CountingTokenizer:
    """A tokenizer that records how many characters it was given to encode."""

    def __init__(self, tok):
        self.tok, self.chars = tok, 0
        self.eod_id = tok.eod_id

    def encode(self, text):
        self.chars += len(text)
        return self.tok.encode(text)


def test_a_prefix_longer_than_the_context_encodes_only_its_tail(tokenizer):
    """A 200 000-character prefix ran for minutes with no output: the model
    sees its last tokens only, so only its end is encoded."""
    counting = CountingTokenizer(tokenizer)
    item = ClozeItem("甲乙丙丁，" * 40_000, ITEM.suffix, ITEM.candidates, ITEM.answer)

    enc = encode_item(item, counting, 32)

    assert counting.chars < 1_000
    assert len(enc.context) + max(map(len, enc.continuations)) == 32


def test_the_tail_of_a_long_prefix_gives_the_tokens_the_whole_gives(
    tokenizer, news_corpus
):
    prefix = "".join(d.text for d in news_corpus.documents[:20])
    assert len(prefix) > 2_000
    item = ClozeItem(prefix, ITEM.suffix, ITEM.candidates, ITEM.answer)
    for max_len in (16, 64, 256):
        enc = encode_item(item, tokenizer, max_len)
        keep = max_len - max(map(len, enc.continuations))
        assert enc.context == [tokenizer.eod_id, *tokenizer.encode(prefix)][-keep:]
    # a prefix the context holds whole keeps its <eod>
    assert encode_item(ITEM, tokenizer, 256).context[0] == tokenizer.eod_id

"""POS tagging for cloze items (``jieba.posseg``, for corpora without tags):
its HMM runs once per distinct run of characters, with the tags unchanged."""

import jieba.posseg as pseg

from aisyn.data.cloze import tag_many
from aisyn.data.corpora import load_corpus


def test_the_hmm_runs_once_per_distinct_block(monkeypatch, tmp_path):
    monkeypatch.setenv("AISYN_CACHE", str(tmp_path))  # no cached tags
    texts = [d.text for d in load_corpus("reviews").split("train")[:40]]
    plain = [tuple((p.word, p.flag) for p in pseg.cut(t)) for t in texts]
    calls = []
    real = pseg.viterbi

    def counting(obs, *tables):
        calls.append(obs)
        return real(obs, *tables)

    monkeypatch.setattr(pseg, "viterbi", counting)

    tagged = tag_many(texts + texts)  # every document twice

    assert tagged == plain + plain  # posseg's own tags
    assert calls and len(calls) == len(set(calls))  # each block's HMM once
    assert pseg.viterbi is counting  # posseg is as it was after tagging

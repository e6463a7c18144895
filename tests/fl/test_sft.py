"""Supervised cloze data: the loss covers exactly the answer, bad data is refused."""

from __future__ import annotations

import json

import pytest
import torch

from aisyn.data.cloze import ClozeItem
from aisyn.data.sft import (
    IGNORE,
    SFTData,
    SFTError,
    encode_item,
    encode_items,
    open_sft_many,
    prepare_sft,
    targets_for,
)


def test_loss_mask_covers_exactly_the_answer_tokens(sft_dirs, tokenizer):
    # Prepare
    data = SFTData.open(sft_dirs["news"], "train")
    # Execute
    inputs, targets = data.batch(range(40))
    # Assert: the supervised targets are the answer tokens then <eod>, nothing else
    for row in range(40):
        start, length = int(data.answer_start[row]), int(data.length[row])
        supervised = targets[row][targets[row] != IGNORE].tolist()
        assert supervised == data.tokens[row, start:length].tolist()
        assert supervised[-1] == tokenizer.eod_id
        assert (targets[row] != IGNORE).sum() == length - start
        # inputs are the sequence shifted: position j predicts token j + 1
        assert (
            inputs[row, : length - 1].tolist()
            == data.tokens[row, : length - 1].tolist()
        )


def test_encoded_item_ends_with_answer_and_fits(tokenizer):
    # Prepare
    item = ClozeItem(
        "今天北京下雪了。" * 30, "明天北京放晴。" * 30, ("北京", "上海"), "北京"
    )
    # Execute
    ids, start = encode_item(item, tokenizer, 48)
    enc = encode_items([item], tokenizer, 48)
    inputs, targets = targets_for(enc["tokens"], enc["answer_start"], enc["length"])
    # Assert
    assert len(ids) <= 49
    assert ids[start:] == [*tokenizer.encode("北京"), tokenizer.eod_id]
    prompt = tokenizer.decode(ids[1:start])
    # after the blank first, then the text up to it: the answer continues it
    assert prompt.startswith("＿＿明天北京放晴。") and prompt.endswith("北京下雪了。")
    assert tokenizer.decode(targets[0][targets[0] != IGNORE].tolist()) == "北京"


def test_sft_data_from_another_tokenizer_is_refused(sft_dirs):
    with pytest.raises(SFTError, match="tokenizer"):
        SFTData.open(sft_dirs["news"], "train", tokenizer_sha256="0" * 64)


def test_sft_corrupt_or_missing_data_is_refused(sft_dirs, tmp_path):
    # Prepare: a copy whose tensor file is damaged
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(sft_dirs["reviews"], bad)
    blob = bytearray((bad / "train.safetensors").read_bytes())
    blob[-5] ^= 0xFF
    (bad / "train.safetensors").write_bytes(bytes(blob))
    # Execute / Assert
    with pytest.raises(SFTError, match="corrupt"):
        SFTData.open(bad, "train")
    with pytest.raises(SFTError, match="not found"):
        SFTData.open(tmp_path / "nowhere", "train")
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["seq_len"] = 32
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SFTError, match="seq_len"):
        open_sft_many([sft_dirs["news"], bad], "valid")


def test_sft_corrupt_manifest_is_one_line(sft_dirs, tmp_path):
    # Prepare: a copy whose manifest lacks what prepare-sft writes
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(sft_dirs["news"], bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    del manifest["splits"]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    # Execute / Assert: the error names it, as for token shards
    with pytest.raises(
        SFTError, match="corrupt manifest \\(bad or missing 'splits'\\)"
    ):
        SFTData.open(bad, "train")


def test_pooled_batches_mix_sources(sft_dirs):
    from aisyn.train.objective import SFTBatches

    # Prepare
    sources = open_sft_many([sft_dirs["news"], sft_dirs["reviews"]])
    batches = SFTBatches(sources, seed=3, device=torch.device("cpu"))
    # Execute: the same position twice, once by skipping there
    first = [batches.next(8) for _ in range(3)]
    again = SFTBatches(sources, seed=3, device=torch.device("cpu"))
    again.skip(16)
    # Assert: deterministic and resumable
    third = again.next(8)
    assert torch.equal(third[0], first[2][0]) and torch.equal(third[1], first[2][1])


def _news(n: int):
    """The first ``n`` news documents (the ``sft_dirs`` fixture's corpus)."""
    from aisyn.data.corpora import Corpus, load_corpus

    news = load_corpus("news")
    return Corpus(news.name, news.documents[:n], news.sources)


def test_supervise_item_covers_the_whole_item_and_keeps_its_tokens(tokenizer, tmp_path):
    # Prepare: the same documents, the loss on the answer or the whole item
    corpus = _news(200)
    for supervise in ("answer", "item"):
        m = prepare_sft(
            corpus, tokenizer, 48, tmp_path / supervise, per_document=2,
            test_per_document=2, supervise=supervise,
        )  # fmt: skip
        assert m["supervise"] == supervise
    answer = SFTData.open(tmp_path / "answer", "train")
    item = SFTData.open(tmp_path / "item", "train")
    # Execute
    _, targets = item.batch(range(40))
    # Assert: the same tokens; every one after the leading <eod> supervised
    assert torch.equal(item.tokens, answer.tokens)
    assert (item.answer_start == 1).all()
    for row in range(40):
        length = int(item.length[row])
        assert targets[row][targets[row] != IGNORE].tolist() == (
            item.tokens[row, 1:length].tolist()
        )
    assert (targets != IGNORE).sum() > 2 * (answer.batch(range(40))[1] != IGNORE).sum()


def test_an_unknown_supervise_is_refused_before_anything_is_written(
    tokenizer, tmp_path
):
    corpus = _news(20)
    with pytest.raises(ValueError, match="--supervise must be one of answer, item"):
        prepare_sft(corpus, tokenizer, 48, tmp_path / "out", supervise="prompt")
    assert not (tmp_path / "out").exists()

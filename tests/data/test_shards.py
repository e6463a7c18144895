import json
import re
import shutil

import numpy as np
import pytest

from aisyn.data.shards import ShardError, TokenShards, open_many, pack, prepare


def test_pack_joins_documents_with_eod_and_drops_the_tail():
    rows = pack([[5, 6], [7], [8, 9, 10]], eod_id=1, sample_len=4)

    assert rows.tolist() == [[5, 6, 1, 7], [1, 8, 9, 10]]


def test_prepared_shards_hold_the_documents(news_data, news_corpus, tokenizer):
    ds = TokenShards.open(news_data, "train")
    m = ds.manifest
    first_train = [d for d in news_corpus.documents[:1500] if d.split == "train"]

    expected = tokenizer.encode(first_train[0].text) + [tokenizer.eod_id]
    got = ds[0].tolist()

    assert ds.seq_len == 32 and len(got) == 33
    n = min(33, len(expected))
    assert got[:n] == expected[:n]
    assert m["tokenizer"]["sha256"] == tokenizer.sha256
    assert m["splits"]["train"]["documents"] == len(first_train)
    assert len(ds) == m["splits"]["train"]["samples"] > 100
    assert ds.batch([0, 2]).shape == (2, 33)
    assert "sha1" in m["split_rule"]
    assert len(TokenShards.open(news_data, "test")) > 0


def test_mismatched_tokenizer_or_seq_len_is_refused(news_data):
    """The refusal says which `aisyn prepare` re-makes the folder."""
    with pytest.raises(ShardError, match="made with tokenizer") as e:
        TokenShards.open(news_data, "train", tokenizer_sha256="0" * 64)
    assert "re-run `aisyn prepare --corpus news --out NEW_DIR --seq-len 32 " in str(
        e.value
    )
    assert "--tokenizer T` with T the model's tokenizer" in str(e.value)
    with pytest.raises(ShardError, match="seq_len 32, expected 64") as e:
        TokenShards.open(news_data, "train", seq_len=64)
    assert "`aisyn prepare --corpus news --out NEW_DIR --seq-len 64`" in str(e.value)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda m: m.pop("splits"), "corrupt manifest (bad or missing 'splits')"),
        (lambda m: m.update(tokenizer=[1]), "corrupt manifest"),
        (lambda m: m.update(dtype="<f8"), "shard dtype float64 is not prepare's"),
        (
            lambda m: m["splits"]["train"]["shards"][0].update(file="../x.bin"),
            "shard '../x.bin' is not a file name",
        ),
        (lambda m: m.update(x="[" * 100_000), None),  # a long string is fine
    ],
)
def test_a_corrupt_manifest_is_one_line(tmp_path, news_data, change, expected):
    copy = tmp_path / "copy"
    shutil.copytree(news_data, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    sha = manifest["tokenizer"]["sha256"]  # checked, so the tokenizer entry is read
    change(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    if expected is None:
        assert len(TokenShards.open(copy, "train", verify=False)) > 0
        return
    with pytest.raises(ShardError, match=re.escape(expected)):
        TokenShards.open(copy, "train", tokenizer_sha256=sha, verify=False)


def test_a_deeply_nested_manifest_is_one_line(tmp_path, news_data):
    copy = tmp_path / "copy"
    shutil.copytree(news_data, copy)
    (copy / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ShardError, match="nested deeper than 32 levels"):
        TokenShards.open(copy, "train")


def test_open_many_checks_agreement(tmp_path, news_data, news_corpus, tokenizer):
    other = tmp_path / "other"
    prepare(news_corpus, tokenizer, 16, other, max_documents=200)

    with pytest.raises(ShardError, match="seq_len 16, expected 32"):
        open_many([news_data, other])


def test_corrupt_and_missing_shards(tmp_path, news_data):
    copy = tmp_path / "copy"
    shutil.copytree(news_data, copy)
    shard = copy / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))

    with pytest.raises(ShardError, match="train-00000.bin: corrupt shard: SHA-256"):
        TokenShards.open(copy, "train")
    shard.write_bytes(bytes(data[:-7]))
    with pytest.raises(ShardError, match="corrupt shard: .* bytes, manifest says"):
        TokenShards.open(copy, "train")
    shard.unlink()
    with pytest.raises(ShardError, match="shard file missing"):
        TokenShards.open(copy, "train")
    (copy / "manifest.json").write_text("{broken")
    with pytest.raises(ShardError, match="corrupt manifest"):
        TokenShards.open(copy, "train")
    with pytest.raises(ShardError, match="data folder not found"):
        TokenShards.open(tmp_path / "absent", "train")


def test_prepare_never_overwrites_without_asking(tmp_path, news_corpus, tokenizer):
    out = tmp_path / "d"
    prepare(news_corpus, tokenizer, 16, out, max_documents=100)
    before = (out / "manifest.json").read_text()

    with pytest.raises(FileExistsError, match="exists and is not empty"):
        prepare(news_corpus, tokenizer, 8, out, max_documents=100)
    assert (out / "manifest.json").read_text() == before

    prepare(news_corpus, tokenizer, 8, out, max_documents=100, overwrite=True)
    assert json.loads((out / "manifest.json").read_text())["seq_len"] == 8
    assert np.fromfile(out / "train-00000.bin", dtype="<u2").size % 9 == 0

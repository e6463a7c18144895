"""Partitions of SFT data: scenario 4's IID deal (every item in exactly one part,
mixed domains) and the Dirichlet deal over more clients than domains (skewed by
alpha, seeded, refused in one line when it cannot give every client items)."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from aisyn.data.sft import SFTData
from aisyn.fl.partition import partition_dirichlet, partition_iid


def test_iid_parts_cover_the_pooled_items_once_each(sft_dirs, tmp_path):
    # Prepare
    news = SFTData.open(sft_dirs["news"])
    reviews = SFTData.open(sft_dirs["reviews"])
    # Execute
    parts = partition_iid([sft_dirs["news"], sft_dirs["reviews"]], tmp_path / "iid", 2)
    # Assert: sizes add up, rows are exactly the pooled rows, domains are mixed
    loaded = [SFTData.open(p) for p in parts]
    assert sum(len(p) for p in loaded) == len(news) + len(reviews)
    assert abs(len(loaded[0]) - len(loaded[1])) <= 1
    pooled = Counter(
        tuple(r.tolist()) for r in torch.cat([news.tokens, reviews.tokens])
    )
    got = Counter(tuple(r.tolist()) for p in loaded for r in p.tokens)
    assert got == pooled  # as multisets: the corpora repeat a few items
    news_rows = {tuple(r.tolist()) for r in news.tokens}
    for p in loaded:
        share = sum(tuple(r.tolist()) in news_rows for r in p.tokens) / len(p)
        expected = len(news) / (len(news) + len(reviews))
        assert abs(share - expected) < 0.1
    assert len(loaded[0].test_items()) == len(news.test_items()) + len(
        reviews.test_items()
    )
    with pytest.raises(FileExistsError):
        partition_iid([sft_dirs["news"]], tmp_path / "iid", 2)


def _rows(folder) -> Counter:
    return Counter(tuple(r.tolist()) for r in SFTData.open(folder).tokens)


def news_share(part, news_rows: set) -> float:
    data = SFTData.open(part)
    return sum(tuple(r.tolist()) in news_rows for r in data.tokens) / len(data)


@pytest.mark.parametrize("alpha", [0.1, 1.0])
def test_dirichlet_parts_cover_every_item_once_skewed_by_alpha(
    sft_dirs, tmp_path, alpha
):
    # Prepare
    dirs = [sft_dirs["news"], sft_dirs["reviews"]]
    news, reviews = (SFTData.open(d) for d in dirs)
    # Execute
    parts = partition_dirichlet(dirs, tmp_path / "dir", 4, alpha, seed=3)
    # Assert: every train and valid item once, every client some training items
    assert len(parts) == 4
    assert sum((_rows(p) for p in parts), Counter()) == Counter(
        tuple(r.tolist()) for r in torch.cat([news.tokens, reviews.tokens])
    )
    valid = [SFTData.open(p, "valid") for p in parts]
    assert sum(len(v) for v in valid) == len(SFTData.open(dirs[0], "valid")) + len(
        SFTData.open(dirs[1], "valid")
    )
    assert all(len(SFTData.open(p)) > 0 for p in parts)
    # the manifest says what each part holds, and it is what the part holds
    news_rows = {tuple(r.tolist()) for r in news.tokens} - {
        tuple(r.tolist()) for r in reviews.tokens
    }
    for p in parts:
        record = json.loads((p / "manifest.json").read_text())["partition"]
        assert record["kind"] == "dirichlet" and record["alpha"] == alpha
        held = record["train_items_per_domain"]
        assert sum(held.values()) == len(SFTData.open(p))
    # skewed: at alpha 0.1 the parts are far from the pooled news share
    pooled = len(news) / (len(news) + len(reviews))
    spread = max(abs(news_share(p, news_rows) - pooled) for p in parts)
    assert spread > (0.3 if alpha == 0.1 else 0.05)
    # seeded: the same seed deals the same parts, another seed others
    again = partition_dirichlet(dirs, tmp_path / "again", 4, alpha, seed=3)
    assert [_rows(p) for p in again] == [_rows(p) for p in parts]
    other = partition_dirichlet(dirs, tmp_path / "other", 4, alpha, seed=4)
    assert [_rows(p) for p in other] != [_rows(p) for p in parts]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(parts=4, alpha=0.0), "--alpha must be a finite number > 0, got 0"),
        (dict(parts=4, alpha=-1.0), "--alpha must be a finite number > 0"),
        (dict(parts=4, alpha=math.nan), "--alpha must be a finite number > 0"),
        (dict(parts=4, alpha=math.inf), "--alpha must be a finite number > 0"),
        (dict(parts=1, alpha=1.0), "--parts must be an integer >= 2"),
        (dict(parts=10**7, alpha=1.0), "--parts 10000000 is more than the"),
        (dict(parts=400, alpha=0.001), "left a client without training items"),
    ],
)
def test_a_bad_dirichlet_partition_is_refused_before_anything_is_written(
    sft_dirs, tmp_path, kw, message
):
    with pytest.raises(ValueError, match=message):
        partition_dirichlet(
            [sft_dirs["news"], sft_dirs["reviews"]], tmp_path / "out", **kw
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.heavy
def test_the_cli_deals_dirichlet_parts_and_refuses_a_bad_alpha(
    sft_dirs, tmp_path, capsys
):
    from aisyn.cli import main

    data = ["--data", str(sft_dirs["news"]), "--data", str(sft_dirs["reviews"])]
    out = tmp_path / "cli"
    rc = main(["fl", "partition", *data, "--parts", "4", "--alpha", "0.1",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["parts"] == [str(out / f"part{i}") for i in range(4)]
    with pytest.raises(SystemExit) as e:
        main(["fl", "partition", *data, "--alpha", "0", "--out", str(tmp_path / "x")])
    assert e.value.code == 2
    assert "argument --alpha" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

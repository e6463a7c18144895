"""A lockstep step pays one round trip per direction per micro-batch and no
more: the messages each party sends in a TRAIN round are exactly the control
tensor, the cut tensors (two per micro-batch each way) and one scalar each way
for the global gradient norm. On a wire where every message costs at least a
round trip, an extra message per micro-batch would cost a round trip each."""

from __future__ import annotations

import collections

import pytest
from conftest import CUT, train_cfg

from aisyn.link import _core
from aisyn.split.client.train import split_train
from aisyn.split.session import SplitOptions


@pytest.mark.parametrize("window", [0, 2], ids=["lockstep", "pipelined"])
def test_a_train_round_sends_only_what_it_must(
    tmp_path, news_data, split_config, monkeypatch, window
):
    sent: dict[tuple[str, int], collections.Counter] = collections.defaultdict(
        collections.Counter
    )
    real = _core.LinkCore._enqueue

    def record(self, job):
        if job.key is not None:
            sent[(self._name, job.key.step)][(job.key.kind, job.key.tag)] += 1
        return real(self, job)

    monkeypatch.setattr(_core.LinkCore, "_enqueue", record)
    cfg = train_cfg(steps=2, batch_size=8, micro_batch_size=2, eval_every=0)
    split_train(
        split_config,
        [news_data],
        tmp_path / "split",
        cfg,
        SplitOptions(cut=CUT, mode="local", window=window),
        progress=False,
    )
    micro = cfg.batch_size // cfg.micro_batch_size
    train_rounds = [r for (name, r), c in sent.items() if c[("tensor", "act")]]
    assert len(train_rounds) == 2
    for r in train_rounds:
        by_party = {name: c for (name, step), c in sent.items() if step == r}
        a = next(c for name, c in by_party.items() if c[("tensor", "act")])
        b = next(c for name, c in by_party.items() if c is not a)
        assert a == {
            ("tensor", "ctl"): 1,
            ("tensor", "act"): micro,
            ("tensor", "gout"): micro,
            ("scalar", "sqnorm"): 1,
        }
        assert b == {
            ("tensor", "out"): micro,
            ("tensor", "gact"): micro,
            ("scalar", "sqnorm"): 1,
        }

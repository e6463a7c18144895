"""``--local-epochs``: each client's steps per round follow its own data
(local-epochs x training items / batch-size), FedAvg's own measure of local
work, instead of one ``--local-steps`` for every client."""

from __future__ import annotations

import json

import pytest
import torch

from aisyn.data.sft import SFTData
from aisyn.fl.client import ClientNode, client_train
from aisyn.fl.records import record_to_tensors, tensors_to_record
from aisyn.fl.round_message import round_config
from aisyn.fl.settings import FLSettings
from aisyn.splitfed.run import check_settings
from aisyn.train.lora import apply_method, trainable_tensors
from aisyn.train.models import describe_base, load_base

LOCAL = dict(rounds=2, batch_size=4, lr=1e-3, warmup=1, eval_items=4, min_clients=1)


def test_a_clients_steps_follow_its_items_and_bad_values_are_one_line():
    s = FLSettings.from_dict(dict(LOCAL, local_steps=7, local_epochs=0.5))
    # 0.5 x 30 / 4 = 3.75 -> 4 steps a round, its schedule over 2 x 4 steps
    mine = s.for_items(30)
    assert (mine.local_steps, mine.train.steps, mine.local_epochs) == (4, 8, 0.0)
    assert s.for_items(1).local_steps == 1  # never no work at all
    assert s.for_items(300).local_steps == 38
    plain = FLSettings.from_dict(dict(LOCAL, local_steps=7))
    assert plain.for_items(30) is plain  # off: every client local-steps
    # an update weighs by its examples per step (by its examples when off)
    assert s.update_weight(30) == 30 / 4 and s.update_weight(300) == 300 / 38
    assert plain.update_weight(30) == 30
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="local-epochs"):
            FLSettings.from_dict({"local_epochs": bad})
    with pytest.raises(ValueError, match="set local-epochs 0"):
        FLSettings.from_dict(
            dict(local_epochs=0.5, secure_aggregation=True, max_norm_ratio=0)
        )
    with pytest.raises(ValueError, match="splitfed: .*set local-epochs 0"):
        check_settings(FLSettings.from_dict(dict(LOCAL, local_epochs=0.5)), {"a": 0})


@pytest.mark.heavy
def test_each_client_trains_its_own_steps_exactly_as_local_steps_would(
    base_run, sft_dirs, tmp_path
):
    # Prepare: local-epochs giving the news client 3 steps a round
    info = describe_base(base_run)
    model, _ = load_base(info)
    items = {n: len(SFTData.open(d, "train")) for n, d in sft_dirs.items()}
    epochs = 3 * LOCAL["batch_size"] / items["news"]
    by_items = FLSettings.from_dict(dict(LOCAL, local_steps=5, local_epochs=epochs))
    by_steps = FLSettings.from_dict(dict(LOCAL, local_steps=3))
    spec_model = apply_method(model, by_steps.method_spec())
    glob = trainable_tensors(spec_model)
    spec = {n: tuple(p.shape) for n, p in spec_model}

    def train(settings, name, out):
        config = round_config(settings, info)
        config["server-round"] = 2  # round 2: steps 3..5 of the client's own
        node = ClientNode(name, sft_dirs[name], base_run, tmp_path / out)
        records, _ = client_train(node, config, tensors_to_record(glob))
        metrics = [json.loads(x) for x in (tmp_path / out / "metrics.jsonl").open()]
        return record_to_tensors(records["arrays"], spec), metrics

    # Execute
    news, news_log = train(by_items, "news", "news-epochs")
    plain, _ = train(by_steps, "news", "news-steps")
    reviews, reviews_log = train(by_items, "reviews", "reviews-epochs")
    # Assert: the news client took its 3 steps, on the schedule and data
    # order of 2 x 3 steps, to the last bit as --local-steps 3 does
    assert all(torch.equal(news[k], plain[k]) for k in plain)
    assert [r["step"] for r in news_log if "loss" in r] == [4, 6]  # range edges
    assert news_log[-1]["step"] == 6
    # the reviews client its own number, by its items
    own = max(1, round(epochs * items["reviews"] / LOCAL["batch_size"]))
    assert own != 3
    assert reviews_log[-1]["step"] == 2 * own
    assert not all(torch.equal(reviews[k], glob[k]) for k in glob)
    # the run folder records the federation's settings, not the client's share
    saved = json.loads((tmp_path / "reviews-epochs" / "config.json").read_text())
    assert saved["federated"]["local_epochs"] == epochs
    assert saved["federated"]["local_steps"] == 5

"""``--local-optimizer kept``: each client goes on with its own AdamW moments
from round to round (kept in its run folder, never sent), so a lone client's
rounds are exactly one uninterrupted fine-tuning run; ``fresh`` (the default)
starts a new AdamW every round."""

from __future__ import annotations

import pytest
import torch

from aisyn.fl.client import OPTIMIZERS, ClientNode, client_train
from aisyn.fl.records import record_to_tensors, tensors_to_record
from aisyn.fl.round_message import round_config, setting_differences
from aisyn.fl.settings import FLSettings
from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.finetune import finetune
from aisyn.train.lora import apply_method, trainable_tensors
from aisyn.train.models import describe_base, load_base

ROUNDS, E = 2, 3
LOCAL = dict(batch_size=4, lr=3e-3, warmup=1, seed=5, grad_clip=1.0, weight_decay=0.1)


def _settings(local_optimizer: str) -> FLSettings:
    return FLSettings.from_dict(
        dict(
            rounds=ROUNDS,
            local_steps=E,
            min_clients=1,
            eval_items=4,
            local_optimizer=local_optimizer,
            **LOCAL,
        )
    )


def _federate_alone(base_run, data, out, local_optimizer: str) -> dict:
    """ROUNDS rounds of one client, each round's global model its last reply
    (FedAvg's mean of one update is that update)."""
    settings = _settings(local_optimizer)
    info = describe_base(base_run)
    model, _ = load_base(info)
    trainable = apply_method(model, settings.method_spec())
    spec = {n: tuple(p.shape) for n, p in trainable}
    glob = trainable_tensors(trainable)
    node = ClientNode("alone", data, base_run, out)
    for server_round in range(1, ROUNDS + 1):
        config = round_config(settings, info)
        config["server-round"] = server_round
        records, _ = client_train(node, config, tensors_to_record(glob))
        glob = record_to_tensors(records["arrays"], spec)
    return glob


@pytest.mark.heavy
def test_a_lone_client_keeping_its_optimizer_is_one_uninterrupted_finetune(
    base_run, sft_dirs, tmp_path
):
    # Prepare: the same steps, rate schedule and data order as one run
    data = sft_dirs["news"]
    cfg = TrainConfig(
        steps=ROUNDS * E,
        batch_size=LOCAL["batch_size"],
        lr=LOCAL["lr"],
        warmup_steps=LOCAL["warmup"],
        seed=LOCAL["seed"],
        grad_clip=LOCAL["grad_clip"],
        weight_decay=LOCAL["weight_decay"],
        log_every=1,
    )
    finetune(base_run, [data], tmp_path / "one-run", cfg, progress=False)
    one_run = ckpt.read_tensors(ckpt.model_file(tmp_path / "one-run"))
    # Execute
    kept = _federate_alone(base_run, data, tmp_path / "kept", "kept")
    fresh = _federate_alone(base_run, data, tmp_path / "fresh", "fresh")
    # Assert: kept moments continue the one run to the last bit; fresh ones
    # (a new AdamW at round 2: sign-like first steps) leave it
    assert kept.keys() <= one_run.keys()
    assert all(torch.equal(kept[k], one_run[k]) for k in kept)
    assert not all(torch.equal(fresh[k], one_run[k]) for k in fresh)
    # the moments stayed in the client's own folder, one file per round
    saved = sorted(p.name for p in (tmp_path / "kept" / "optimizer").iterdir())
    assert saved == ["adamw-00001.safetensors", "adamw-00002.safetensors"]
    assert not (tmp_path / "fresh" / "optimizer").exists()


def test_a_damaged_kept_optimizer_is_refused_in_one_line(base_run, sft_dirs, tmp_path):
    # Prepare: a round-1 file that is not safetensors, then one of another model
    settings = _settings("kept")
    info = describe_base(base_run)
    model, _ = load_base(info)
    glob = trainable_tensors(apply_method(model, settings.method_spec()))
    config = round_config(settings, info)
    config["server-round"] = 2
    out = tmp_path / "client"
    node = ClientNode("news", sft_dirs["news"], base_run, out)
    path = OPTIMIZERS.path(out, 1)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x00" * 64)
    # Execute / Assert
    with pytest.raises(ValueError, match=r"client news: bad kept optimizer: .*adamw"):
        client_train(node, config, tensors_to_record(glob))
    OPTIMIZERS.save(out, 1, {"nowhere.weight::exp_avg": torch.zeros(2)})
    with pytest.raises(ValueError, match="unknown parameter nowhere.weight"):
        client_train(node, config, tensors_to_record(glob))
    OPTIMIZERS.save(out, 1, {f"{next(iter(glob))}::exp_avg": torch.zeros(1)})
    with pytest.raises(ValueError, match="has shape"):
        client_train(node, config, tensors_to_record(glob))


def test_the_setting_is_checked_and_an_older_record_counts_at_fresh():
    with pytest.raises(ValueError, match="unknown local-optimizer 'warm'"):
        FLSettings.from_dict({"local_optimizer": "warm"})
    now = FLSettings().to_dict()
    older = {k: v for k, v in now.items() if k != "local_optimizer"}
    assert setting_differences(older, now) == []
    kept = FLSettings(local_optimizer="kept").to_dict()
    assert setting_differences(older, kept) == ["local_optimizer"]
    assert "local_optimizer" in setting_differences(None, now)  # no record: all differ

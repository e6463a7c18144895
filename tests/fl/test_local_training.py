"""Local training: the FedProx term, LoRA payloads, and a client's round in-process."""

from __future__ import annotations

import json

import pytest
import torch

from aisyn.fl.client import add_proximal_grad
from aisyn.fl.records import tensors_to_record
from aisyn.fl.settings import FLSettings
from aisyn.model.families import build_model
from aisyn.train.config import TrainConfig
from aisyn.train.executor import LocalExecutor
from aisyn.train.lora import Method, apply_method, merged_state_dict, trainable_tensors
from aisyn.train.objective import sft_step_batch


def _batch(cfg, n=4, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, cfg.vocab_size, (n, t), generator=g)
    targets = torch.full((n, t), -100)
    targets[:, -3:] = torch.randint(0, cfg.vocab_size, (n, 3), generator=g)
    return inputs, targets


def test_fedprox_adds_mu_times_the_distance_to_the_global_model(fl_config):
    # Prepare: a model moved away from its "global" copy
    model = build_model(fl_config, seed=1)
    trainable = list(model.named_parameters())
    anchor = {n: p.detach().clone() for n, p in trainable}
    with torch.no_grad():
        for _, p in trainable:
            p.add_(0.01 * torch.randn_like(p))
    inputs, targets = _batch(fl_config)
    from aisyn.train.objective import sft_loss_sum

    loss, _ = sft_loss_sum(model, inputs, targets)
    loss.backward()
    plain = {n: p.grad.clone() for n, p in trainable}
    mu = 0.3
    # Execute
    value = add_proximal_grad(trainable, anchor, mu)
    # Assert: grad += mu * (w - w_global), value = mu/2 * ||w - w_global||^2
    dist2 = 0.0
    for n, p in trainable:
        torch.testing.assert_close(p.grad, plain[n] + mu * (p.detach() - anchor[n]))
        dist2 += float((p.detach() - anchor[n]).pow(2).sum())
    assert value == pytest.approx(0.5 * mu * dist2, rel=1e-5)


def test_fedprox_step_stays_closer_to_the_global_model(fl_config):
    # Prepare: two identical models, one step each, with and without the term
    def one_step(mu):
        torch.manual_seed(0)
        model = build_model(fl_config, seed=1)
        trainable = list(model.named_parameters())
        anchor = {n: p.detach().clone() for n, p in trainable}
        with torch.no_grad():  # start away from the global model
            for _, p in trainable:
                p.add_(0.05)
        opt = torch.optim.SGD([p for _, p in trainable], lr=1e-2)
        inputs, targets = _batch(fl_config)
        executor = LocalExecutor(
            model,
            trainable,
            TrainConfig(batch_size=4, grad_clip=0.0),
            lr_at=lambda step: 1e-2,
            optimizer=opt,
            regularizer=lambda: {"prox": add_proximal_grad(trainable, anchor, mu)},
        )
        executor.step(0, sft_step_batch(inputs, targets, micro=4))
        return sum(float((p.detach() - anchor[n]).pow(2).sum()) for n, p in trainable)

    # Execute
    without, with_prox = one_step(0.0), one_step(10.0)
    # Assert: with SGD the term pulls every weight back by lr*mu*(w - w_g)
    assert with_prox < without


def test_lora_payload_contains_only_adapter_tensors(fl_config):
    # Prepare
    model = build_model(fl_config, seed=0)
    # Execute
    trainable = apply_method(model, Method("lora", rank=4), seed=0)
    record = tensors_to_record(trainable_tensors(trainable))
    # Assert: A and B for q,k,v,c_proj (attn) + c_fc, c_proj (mlp) in every block
    names = list(record.keys())
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == fl_config.num_layers * 6 * 2
    n_full = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    n_lora = sum(a.numpy().size for a in record.values())
    assert n_lora < n_full / 5
    assert all(
        not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n
    )


def test_merged_lora_weights_give_the_same_model(fl_config):
    # Prepare: adapters with non-zero B, so they change the function
    model = build_model(fl_config, seed=0)
    trainable = apply_method(model, Method("lora", rank=4), seed=0)
    with torch.no_grad():
        for n, p in trainable:
            if "lora_B" in n:
                p.normal_(0, 0.05)
    x = torch.randint(0, 8000, (2, 10))
    expected = model(x)
    # Execute
    plain = build_model(fl_config, seed=123)
    plain.load_state_dict(merged_state_dict(model), strict=False)
    plain.tie_weights()
    # Assert
    torch.testing.assert_close(plain(x), expected, rtol=1e-4, atol=1e-4)


def test_client_round_in_process(base_run, sft_dirs, tmp_path):
    from flwr.app import ConfigRecord

    from aisyn.fl.client import ClientNode, client_train
    from aisyn.fl.round_message import round_config
    from aisyn.train.models import describe_base, load_base

    # Prepare: the server's view (global tensors, round config)
    settings = FLSettings.from_dict(
        dict(
            rounds=2,
            local_steps=3,
            batch_size=4,
            lr=1e-3,
            warmup=1,
            eval_items=8,
            min_clients=1,
        )
    )
    info = describe_base(base_run)
    model, _ = load_base(info)
    glob = trainable_tensors(apply_method(model, settings.method_spec()))
    config = round_config(settings, info)
    config["server-round"] = 2
    node = ClientNode("news", sft_dirs["news"], base_run, tmp_path / "client")
    # Execute
    records, metrics = client_train(node, config, tensors_to_record(glob))
    assert set(records) == {"arrays"}  # (SCAFFOLD's replies add "control")
    arrays = records["arrays"]
    # Assert: same tensors back, changed by training; metrics and run folder written
    assert set(arrays.keys()) == set(glob)
    moved = sum(
        float((torch.from_numpy(arrays[k].numpy()) - v).abs().sum())
        for k, v in glob.items()
    )
    assert moved > 0
    assert metrics["num-examples"] > 0 and metrics["train-s"] > 0
    records = [json.loads(x) for x in (tmp_path / "client" / "metrics.jsonl").open()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps[0] == 4 and steps[-1] == 6  # round 2 continues at global step 4
    assert (tmp_path / "client" / "checkpoints" / "latest").is_file()
    assert (tmp_path / "client" / "loss.png").is_file()
    # a base model that is not the server's is refused with a clear message
    bad = ConfigRecord(dict(config))
    bad["base-fingerprint"] = "f" * 64
    with pytest.raises(ValueError, match="is not the server's"):
        client_train(node, bad, tensors_to_record(glob))


def test_client_with_missing_or_foreign_data_fails_clearly(
    base_run, sft_dirs, tmp_path
):
    import shutil

    from aisyn.fl.launch import check_client

    with pytest.raises(ValueError, match="client acme: .*not found"):
        check_client("acme", tmp_path / "missing", base_run)
    foreign = tmp_path / "foreign"
    shutil.copytree(sft_dirs["reviews"], foreign)
    m = json.loads((foreign / "manifest.json").read_text())
    m["tokenizer"]["sha256"] = "0" * 64
    (foreign / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="client acme: .*tokenizer"):
        check_client("acme", foreign, base_run)


@pytest.mark.parametrize(
    ("preset", "adapted"),
    [
        (
            "llama-tiny",
            (
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ),
        ),
        (
            "qwen2-tiny",
            (
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ),
        ),
        ("gpt2-tiny", ("c_attn", "attn.c_proj", "c_fc", "mlp.c_proj")),
    ],
)
def test_lora_adapts_each_familys_own_linear_layers(preset, adapted):
    """The family names its LoRA targets; every one of them in every block is
    adapted, and merging the adapters gives the same function."""
    from aisyn.model.families import load_config

    cfg = load_config(preset)
    model = build_model(cfg, seed=0)
    trainable = apply_method(model, Method("lora", rank=4), seed=0)
    names = [n for n, _ in trainable]
    assert len(names) == cfg.num_layers * len(adapted) * 2
    for i in range(cfg.num_layers):
        for module in adapted:
            assert any(f".{i}." in n and f"{module}.lora_A" in n for n in names), (
                i,
                module,
            )
    with torch.no_grad():
        for n, p in trainable:
            if "lora_B" in n:
                p.normal_(0, 0.05)
    x = torch.randint(0, cfg.vocab_size, (2, 10))
    expected = model(x)
    plain = build_model(cfg, seed=123)
    plain.load_state_dict(merged_state_dict(model), strict=False)
    plain.tie_weights()
    torch.testing.assert_close(plain(x), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.heavy
def test_a_client_whose_part_has_no_valid_items_reports_its_train_items_loss(
    base_run, sft_dirs, tmp_path
):
    """A small part of a Dirichlet deal can hold no valid items: the client
    reports the global model's loss on its training items' head, not 0."""
    from aisyn.data.sft import SFTData
    from aisyn.fl.client import ClientContext, ClientNode
    from aisyn.fl.partition import partition_dirichlet
    from aisyn.train.models import describe_base

    # Prepare: a part without valid items (a skewed deal over many clients)
    dirs = [sft_dirs["news"], sft_dirs["reviews"]]
    parts = partition_dirichlet(dirs, tmp_path / "parts", 8, 0.1, seed=0)
    empty = [p for p in parts if len(SFTData.open(p, "valid")) == 0]
    assert empty, "the deal was meant to leave a part without valid items"
    settings = FLSettings.from_dict(
        dict(rounds=1, local_steps=1, batch_size=4, eval_items=8, min_clients=1)
    )
    node = ClientNode("small", empty[0], base_run, tmp_path / "client")
    ctx = ClientContext(node, settings, describe_base(base_run).fingerprint)
    # Execute
    loss = ctx.valid_loss()
    # Assert: the loss of real items (a fresh base on cloze answers: nats > 1)
    assert loss > 1.0

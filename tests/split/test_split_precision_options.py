"""``--autocast bf16`` and ``--activation-checkpointing`` in split training:
they reach the compute party through the hello, and split = unsplit with each
(activation checkpointing: the very losses of the run without it)."""

from __future__ import annotations

import json

import pytest
from conftest import CUT, losses, start_server, train_cfg

from aisyn.split import protocol as proto
from aisyn.split.client.train import split_train
from aisyn.split.session import SplitOptions
from aisyn.split.transport import LinkSettings
from aisyn.train.pretrain import train

STEPS = 5


def worst(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) == STEPS
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory, news_data, split_config) -> dict[str, list[float]]:
    """Unsplit losses: fp32, bf16 autocast."""
    root = tmp_path_factory.mktemp("unsplit")
    out = {}
    for name, extra in {"fp32": {}, "bf16": {"autocast": "bf16"}}.items():
        cfg = train_cfg(steps=STEPS, **extra)
        train(split_config, [news_data], root / name, cfg, progress=False)
        out[name] = losses(root / name)
    return out


@pytest.mark.heavy
def test_split_activation_checkpointing_changes_no_loss(
    tmp_path, news_data, split_config, unsplit
):
    # Prepare: both parties recompute their blocks' activations in backward
    cfg = train_cfg(steps=STEPS, activation_checkpointing=True)
    opts = SplitOptions(cut=CUT, mode="local", window=1)
    # Execute
    split_train(split_config, [news_data], tmp_path / "ckpt", cfg, opts, progress=False)
    split_train(
        split_config,
        [news_data],
        tmp_path / "plain",
        train_cfg(steps=STEPS),
        opts,
        progress=False,
    )
    # Assert: the same losses as the split run without it, and as unsplit
    got = losses(tmp_path / "ckpt")
    assert worst(got, losses(tmp_path / "plain")) <= 1e-6
    assert worst(got, unsplit["fp32"]) <= 1e-5


@pytest.mark.heavy
def test_split_bf16_over_grpc_matches_unsplit_bf16(
    tmp_path, news_data, split_config, unsplit, token_file
):
    # Prepare: a gRPC compute party that is told the autocast in the hello
    settings = LinkSettings("127.0.0.1:0", token_file=str(token_file), insecure=True)
    cfg = train_cfg(steps=STEPS, autocast="bf16", activation_checkpointing=True)
    with start_server(split_config, tmp_path / "b", settings) as server:
        peer = LinkSettings(server.address, token_file=str(token_file), insecure=True)
        # Execute
        split_train(
            split_config,
            [news_data],
            tmp_path / "a",
            cfg,
            SplitOptions(cut=CUT, mode="grpc", window=1, peer=peer),
            progress=False,
        )
    # Assert: the losses of unsplit bf16 (here, where split fp32 is unsplit
    # fp32 to the bit, to the bit too: with B in fp32 they would be nearly
    # as far from them as fp32's, 4.5e-6), and B recorded both settings
    got = losses(tmp_path / "a")
    assert worst(got, unsplit["bf16"]) <= 1e-6 < 2e-6 < worst(got, unsplit["fp32"])
    (b_run,) = (tmp_path / "b").iterdir()
    b_config = json.loads((b_run / "config.json").read_text())
    train_of_b = proto.parse_compute_party_train(b_config["train"])
    assert train_of_b.autocast == "bf16"
    assert train_of_b.activation_checkpointing is True


@pytest.mark.parametrize(
    "field,value,problem",
    [
        ("autocast", 1, "autocast must be a string"),
        ("autocast", "fp8", "autocast must be one of auto, bf16, off"),
        ("activation_checkpointing", 1, "activation_checkpointing must be true"),
    ],
)
def test_hello_refuses_bad_precision_settings(field, value, problem):
    # Prepare: a hello's training settings with one field a liar could send
    d = proto.compute_party_train(train_cfg())
    d[field] = value
    # Execute / Assert
    with pytest.raises(proto.ProtocolError, match=problem):
        proto.parse_compute_party_train(d)


def test_hello_refuses_training_settings_beyond_its_fields():
    # Prepare: a hello carrying one field too many (the seed: B never gets
    # A's) and one too few
    d = proto.compute_party_train(train_cfg())
    d["seed"] = 1
    dropped = sorted(d)[0]
    del d[dropped]
    # Execute / Assert: one line naming both
    with pytest.raises(proto.ProtocolError, match=r"missing \[.*unexpected \['seed'\]"):
        proto.parse_compute_party_train(d)
    with pytest.raises(proto.ProtocolError, match=dropped):
        proto.parse_compute_party_train(d)

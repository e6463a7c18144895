"""Split training of GPT-2, Llama and Qwen2 computes the same steps as
``aisyn train``: every step's loss within 1e-5 relative for 20 steps, through
the same parties and link code as PanGu-α (the model's layout says where the
cut points are; the parties never ask which family they hold)."""

from __future__ import annotations

import pytest
from conftest import losses, start_server, train_cfg
from test_exactness import assert_matches

from aisyn.model.hf import HFConfig
from aisyn.split.session import SplitOptions
from aisyn.split.train import split_train
from aisyn.split.transport import LinkSettings
from aisyn.train.loop import train

CONFIGS = {
    "gpt2": HFConfig(
        family="gpt2",
        vocab_size=8000,
        hidden_size=32,
        num_layers=4,
        num_heads=4,
        ffn_size=64,
        seq_len=32,
        norm_eps=1e-5,
        activation="gelu_new",
        tie_embeddings=True,
    ),
    # Grouped-query attention and an untied head.
    "llama": HFConfig(
        family="llama",
        vocab_size=8000,
        hidden_size=32,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        ffn_size=48,
        seq_len=32,
    ),
    # q/k/v biases, one key/value head, a tied head.
    "qwen2": HFConfig(
        family="qwen2",
        vocab_size=8000,
        hidden_size=32,
        num_layers=4,
        num_heads=4,
        num_kv_heads=1,
        ffn_size=48,
        seq_len=32,
        tie_embeddings=True,
    ),
}


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, news_data) -> dict[str, list[float]]:
    out = {}
    for family, cfg in CONFIGS.items():
        run = tmp_path_factory.mktemp(f"baseline-{family}") / "run"
        train(cfg, [news_data], run, train_cfg(eod_reset=True), progress=False)
        out[family] = losses(run)
    return out


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_in_process_split_matches_unsplit_training(
    tmp_path, news_data, baselines, family
):
    out = tmp_path / "split"
    split_train(
        CONFIGS[family],
        [news_data],
        out,
        train_cfg(eod_reset=True),
        SplitOptions(cut="u:1,1", mode="local", window=2),
        progress=False,
    )
    assert_matches(losses(out), baselines[family])


def test_grpc_split_of_a_llama_matches_unsplit_training(
    tmp_path, news_data, baselines, token_file
):
    cfg = CONFIGS["llama"]
    settings = LinkSettings("127.0.0.1:0", token_file=str(token_file), insecure=True)
    with start_server(cfg, tmp_path / "b", settings) as server:
        peer = LinkSettings(server.address, token_file=str(token_file), insecure=True)
        split_train(
            cfg,
            [news_data],
            tmp_path / "a",
            train_cfg(eod_reset=True),
            SplitOptions(cut="u:1,1", mode="grpc", window=2, peer=peer),
            progress=False,
        )
    assert_matches(losses(tmp_path / "a"), baselines["llama"])

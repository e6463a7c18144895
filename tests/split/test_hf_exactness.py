"""Split training of GPT-2, Llama and Qwen2 computes the same steps as
``aisyn train``: every step's loss within 1e-5 relative for 20 steps, through
the same parties and link code as PanGu-α (the model's layout says where the
cut points are; the parties never ask which family they hold)."""

from __future__ import annotations

import pytest
from conftest import losses, start_server, train_cfg
from test_exactness import assert_matches

from aisyn.model.hf import HFConfig
from aisyn.split.client.train import split_train
from aisyn.split.session import SplitOptions
from aisyn.split.transport import LinkSettings
from aisyn.train.pretrain import train

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


@pytest.mark.heavy
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


@pytest.mark.heavy
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


def save_pretrained(family: str, folder, seed: int = 0):
    """A transformers-written folder of a random model shaped as CONFIGS[family]
    (GPT-2's Conv1D weights, Llama's separate head, Qwen2's biases)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from aisyn.model.hf import config_to_hf

    hf_cfg = transformers.AutoConfig.for_model(**config_to_hf(CONFIGS[family]))
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(folder)
    return f"hf:{folder}"


@pytest.mark.heavy
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_split_fine_tuning_of_a_pretrained_folder_matches_unsplit(
    tmp_path, news_data, family
):
    """``--model hf:DIR`` starts both parties from the folder's weights (each
    reads only its own tensors) and matches ``aisyn train --model hf:DIR``."""
    model = save_pretrained(family, tmp_path / "hf")
    train(model, [news_data], tmp_path / "base", train_cfg(), progress=False)
    split_train(
        model,
        [news_data],
        tmp_path / "split",
        train_cfg(),
        SplitOptions(cut="u:1,1", mode="local", window=2),
        progress=False,
    )
    want = losses(tmp_path / "base")
    assert_matches(losses(tmp_path / "split"), want)
    # Not the seeded init: a pretrained start gives other losses.
    assert want != baselines_of(tmp_path, news_data, family)


def baselines_of(tmp_path, news_data, family) -> list[float]:
    run = tmp_path / "seeded"
    train(CONFIGS[family], [news_data], run, train_cfg(steps=1), progress=False)
    return losses(run)


@pytest.mark.heavy
def test_a_grpc_compute_party_serving_a_pretrained_folder(
    tmp_path, news_data, token_file
):
    model = save_pretrained("qwen2", tmp_path / "hf")
    cfg = CONFIGS["qwen2"]
    train(model, [news_data], tmp_path / "base", train_cfg(), progress=False)
    settings = LinkSettings("127.0.0.1:0", token_file=str(token_file), insecure=True)
    with start_server(cfg, tmp_path / "b", settings, init_from=model) as server:
        peer = LinkSettings(server.address, token_file=str(token_file), insecure=True)
        split_train(
            model,
            [news_data],
            tmp_path / "a",
            train_cfg(),
            SplitOptions(cut="u:1,1", mode="grpc", window=2, peer=peer),
            progress=False,
        )
    assert_matches(losses(tmp_path / "a"), losses(tmp_path / "base"))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_split_generation_of_an_hf_family_equals_unsplit(tmp_path, news_data, family):
    """Each party keeps the KV cache of its own layers (grouped-query heads
    for Llama); greedy tokens and every step's logits equal the merged model's."""
    from test_split_generate import NEW, SAMPLINGS, assert_same, split, unsplit

    from aisyn.split.client.merge import merge
    from aisyn.split.session import COMPUTE_DIR

    run = tmp_path / "run"
    split_train(
        CONFIGS[family],
        [news_data],
        run,
        train_cfg(steps=3, ckpt_every=3),
        SplitOptions(cut="u:1,1", mode="local"),
        progress=False,
    )
    merge(run, run / COMPUTE_DIR, tmp_path / "merged")
    assert NEW + 6 <= CONFIGS[family].seq_len
    want = unsplit(tmp_path / "merged", SAMPLINGS["greedy"])
    assert_same(split(run, SAMPLINGS["greedy"], mode="local"), want)

"""GPT-2, Llama and Qwen2: our implementation against transformers' own.

Tiny random models built from configs (nothing downloaded): a folder written
by transformers' ``save_pretrained`` loads into our model with equal logits,
and a folder we write loads into transformers with equal logits.
"""

from __future__ import annotations

import json

import pytest
import torch

from aisyn.model.families import build_model, config_from_dict, load_config
from aisyn.model.hf import HFConfig, HFError, read_hf_folder, write_hf_folder
from aisyn.train.checkpoint import load_weights

transformers = pytest.importorskip("transformers")

HF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=97,
        n_positions=32,
        n_embd=32,
        n_layer=3,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rope_theta=500.0,
        tie_word_embeddings=False,
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    ),
}


def hf_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = HF_CONFIGS[family]()
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager"
    )
    # Random biases and norm gains, so that a misplaced one shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name or "ln" in name else 0.0, 0.1)
    return model.eval()


def tokens(vocab: int = 97, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, 20), generator=g)


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_a_save_pretrained_folder_gives_transformers_logits(family, tmp_path):
    ref = hf_model(family)
    ref.save_pretrained(tmp_path)
    cfg, state = read_hf_folder(tmp_path)
    assert cfg.family == family
    ours = build_model(cfg)
    load_weights(ours, state, str(tmp_path))
    x = tokens()
    with torch.no_grad():
        want = ref(x).logits
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_a_folder_we_write_loads_in_transformers_with_equal_logits(family, tmp_path):
    cfg = load_config(tmp_path_config(family, tmp_path))
    ours = build_model(cfg, seed=5).eval()
    out = tmp_path / "out"
    out.mkdir()
    write_hf_folder(cfg, ours.state_dict(), out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert "auto_map" not in json.loads((out / "config.json").read_text())
    x = tokens(cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x).logits, rtol=1e-5, atol=1e-5)
    # And back again, bit-exact.
    cfg2, state = read_hf_folder(out)
    assert cfg2 == cfg
    again = build_model(cfg2)
    load_weights(again, state, str(out))
    for (n, a), (_, b) in zip(
        ours.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), n


def tmp_path_config(family: str, tmp_path) -> str:
    """hf:DIR of a transformers-written config (weights not needed)."""
    d = tmp_path / f"{family}-config"
    d.mkdir()
    HF_CONFIGS[family]().save_pretrained(d)
    return f"hf:{d}"


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_the_kv_cache_decodes_as_the_full_pass(family):
    cfg = load_config(f"{family}-tiny")
    model = build_model(cfg, seed=2).eval()
    x = tokens(cfg.vocab_size)[:1]
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(x.shape[1])
        first = model(x[:, :12], cache=cache)
        rest = [model(x[:, i : i + 1], cache=cache) for i in range(12, x.shape[1])]
    got = torch.cat([first, *rest], dim=1)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


def test_the_gpt2_of_a_bare_base_model_loads_with_its_prefix(tmp_path):
    """Hub GPT-2 files hold ``GPT2Model`` names (``h.0...``, ``wte``)."""
    ref = hf_model("gpt2")
    ref.transformer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg, state = read_hf_folder(tmp_path)
    ours = build_model(cfg)
    load_weights(ours, state, str(tmp_path))
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"model_type": "mamba"}, "model_type .mamba. is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope type 'yarn'"),
        ({"use_sliding_window": True}, "sliding-window attention is not supported"),
        ({"num_key_value_heads": 3}, "not a multiple of num_kv_heads 3"),
        ({"hidden_act": "relu2"}, "activation 'relu2' is not supported"),
    ],
)
def test_an_unsupported_config_is_refused_in_one_line(edit, message, tmp_path):
    config = HF_CONFIGS["qwen2"]().to_dict()
    config.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFError, match=message) as e:
        read_hf_folder(tmp_path)
    assert "\n" not in str(e.value)


def test_a_folder_without_config_or_weights_is_refused(tmp_path):
    with pytest.raises(HFError, match="no config.json; not a Hugging Face model"):
        load_config(f"hf:{tmp_path}")
    HF_CONFIGS["llama"]().save_pretrained(tmp_path)
    with pytest.raises(HFError, match="no weights"):
        read_hf_folder(tmp_path)


def test_missing_and_extra_tensors_are_named(tmp_path):
    ref = hf_model("llama")
    ref.save_pretrained(tmp_path)
    cfg, state = read_hf_folder(tmp_path)
    model = build_model(cfg)
    state.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_weights(model, state, "x")


def test_configs_round_trip_through_their_dict():
    for name in ("gpt2-tiny", "llama-tiny", "qwen2-tiny"):
        cfg = load_config(name)
        assert isinstance(cfg, HFConfig)
        assert config_from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="model family 'rwkv' is not supported"):
        config_from_dict({"family": "rwkv"})


def test_convert_from_and_to_hf_round_trips_through_the_cli(tmp_path, capsys):
    from aisyn.cli import main

    ref = hf_model("llama")
    ref.save_pretrained(tmp_path / "hf")
    main(
        [
            "convert",
            "--from",
            "hf",
            str(tmp_path / "hf"),
            "--out",
            str(tmp_path / "base"),
        ]
    )
    assert "llama, 3 layers, hidden 32" in capsys.readouterr().out
    main(
        [
            "convert",
            "--to",
            "hf",
            "--run",
            str(tmp_path / "base"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    theirs = ref.state_dict()
    for name, t in back.state_dict().items():  # bit-exact, through our run
        assert torch.equal(t, theirs[name]), name
    # An existing --out is never overwritten.
    before = (tmp_path / "out" / "model.safetensors").read_bytes()
    argv = ["convert", "--to", "hf", "--run", str(tmp_path / "base")]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before


def test_a_pangu_run_goes_out_in_the_ports_layout(tmp_path, capsys):
    from aisyn.cli import main
    from aisyn.convert import write_base
    from aisyn.model.port import read_port

    cfg = load_config("tiny")
    model = build_model(cfg, seed=4)
    from aisyn.train.checkpoint import unique_state_dict

    write_base(
        tmp_path / "base", cfg, unique_state_dict(model), None, {"format": "test"}
    )
    main(
        [
            "convert",
            "--to",
            "hf",
            "--run",
            str(tmp_path / "base"),
            "--out",
            str(tmp_path / "port"),
        ]
    )
    cfg2, state = read_port(tmp_path / "port")
    assert cfg2 == cfg
    again = build_model(cfg2)
    load_weights(again, state, "port")
    for name, t in unique_state_dict(model).items():
        assert torch.equal(t, again.state_dict()[name]), name


def test_training_from_an_hf_folder_starts_from_its_weights(tmp_path, news_data):
    from aisyn.train.config import TrainConfig
    from aisyn.train.pretrain import train
    from aisyn.train.run import read_metrics

    # A tiny random Qwen2 with room for the data tokenizer's 8000 pieces.
    cfg = HF_CONFIGS["qwen2"]()
    cfg.vocab_size = 8000
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    tc = TrainConfig(
        steps=2,
        batch_size=4,
        micro_batch_size=4,
        lr=1e-3,
        warmup_steps=0,
        log_every=1,
        seed=3,
        device="cpu",
    )
    train(f"hf:{tmp_path / 'hf'}", [news_data], tmp_path / "a", tc, progress=False)
    train(
        load_config(
            "qwen2-tiny",
            vocab_size=8000,
            hidden_size=32,
            num_layers=3,
            num_heads=4,
            num_kv_heads=1,
            ffn_size=56,
            seq_len=32,
            tie_embeddings=True,
            rope_theta=1e6,
        ),
        [news_data],
        tmp_path / "b",
        tc,
        progress=False,
    )

    def first_loss(run):
        return next(
            r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r
        )

    # ln(8000) = 8.99 for a random model; the pretrained weights differ from
    # a fresh seeded init of the same shape, so the first losses differ.
    assert first_loss(tmp_path / "a") != first_loss(tmp_path / "b")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["model"]["family"] == "qwen2"
    assert config["init_from"].startswith("hf:")


def test_a_data_tokenizer_larger_than_the_models_vocab_is_refused(tmp_path, news_data):
    from aisyn.train.config import TrainConfig
    from aisyn.train.pretrain import train

    hf_model("llama").save_pretrained(tmp_path / "hf")  # 97 pieces
    with pytest.raises(
        ValueError, match="prepare the data with the model's own tokenizer"
    ):
        train(
            f"hf:{tmp_path / 'hf'}",
            [news_data],
            tmp_path / "a",
            TrainConfig(steps=1, batch_size=2, micro_batch_size=2, device="cpu"),
            progress=False,
        )
    assert not (tmp_path / "a").exists()


def _word_level_tokenizer(folder, words):
    """A tokenizer.json small enough for the 97-row test models, its
    end-of-text token at the test models' eos_token_id (2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "<|endoftext|>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))


def test_the_hf_export_carries_the_runs_tokenizer(tmp_path, capsys):
    """transformers tokenises with the exported folder alone, as the run did."""
    from aisyn.cli import main
    from aisyn.data.tokenizer import load_tokenizer

    hf_model("llama").save_pretrained(tmp_path / "hf")
    _word_level_tokenizer(tmp_path / "hf", ["记者", "北京", "日电", "新华社"])
    argv = ["convert", "--from", "hf", str(tmp_path / "hf"), "--out"]
    assert (
        main([*argv, str(tmp_path / "base"), "--tokenizer", f"hf:{tmp_path}/hf"]) == 0
    )

    argv = ["convert", "--to", "hf", "--run", str(tmp_path / "base")]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0

    assert "tokenizer tokenizer.json" in capsys.readouterr().out
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ours = load_tokenizer(tmp_path / "base" / "tokenizer.model")
    text = "新华社 北京 日电 记者"
    assert theirs(text)["input_ids"] == ours.encode(text) == [6, 4, 5, 3]
    assert theirs.eos_token == "<|endoftext|>"
    assert theirs.eos_token_id == ours.eod_id == 2


def test_a_pangu_export_carries_its_sentencepiece_model(tmp_path):
    from aisyn.convert import convert_to_hf, write_base
    from aisyn.data.tokenizer import load_tokenizer
    from aisyn.train.checkpoint import unique_state_dict

    tok = load_tokenizer(None)
    cfg = load_config("tiny", vocab_size=tok.vocab_size)
    state = unique_state_dict(build_model(cfg, seed=4))
    write_base(tmp_path / "base", cfg, state, tok, {"format": "test"})

    res = convert_to_hf(tmp_path / "base", tmp_path / "port")

    assert res["tokenizer"] == "vocab.model"
    assert (tmp_path / "port" / "vocab.model").read_bytes() == tok.model_bytes


def _qwen2_folder(folder, with_tokenizer: bool):
    """A tiny random Qwen2 with room for the data tokenizer's 8000 pieces,
    and (``with_tokenizer``) its own 21-piece tokenizer.json."""
    cfg = HF_CONFIGS["qwen2"]()
    cfg.vocab_size = 8000
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    if with_tokenizer:
        _word_level_tokenizer(folder, [f"w{i}" for i in range(18)])
    return f"hf:{folder}"


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--steps", "1"],
        ["split", "train", "--mode", "local", "--steps", "1", "--cut", "u:1,1"],
        ["split", "plan", "--party", "A:1:8GB", "--party", "B:1:8GB"],
    ],
)
def test_data_of_another_tokenizer_than_the_hf_folders_is_refused(
    command, tmp_path, news_data, capsys
):
    """Data made with the shipped 8000-piece tokenizer fits a Qwen2 folder's
    8000 rows, but its ids mean other pieces to the folder's own tokenizer."""
    from aisyn.cli import main

    model = _qwen2_folder(tmp_path / "hf", with_tokenizer=True)
    capsys.readouterr()  # save_pretrained's progress bar
    out = ["--out", str(tmp_path / "run")] if "plan" not in command else []
    argv = [*command, "--model", model, "--data", str(news_data), *out]
    assert main([*argv, "--device", "cpu"] if "plan" not in command else argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aisyn: error: "), err
    assert f"but the base model {model} uses" in err[0]
    assert f"re-run `aisyn prepare --tokenizer {model}`" in err[0]
    assert not (tmp_path / "run").exists()


def test_data_of_the_hf_folders_own_tokenizer_passes_its_check(tmp_path):
    from aisyn.data.tokenizer import load_tokenizer
    from aisyn.train.models import model_config_for

    model = _qwen2_folder(tmp_path / "hf", with_tokenizer=True)
    own = load_tokenizer(model).info()  # as `aisyn prepare --tokenizer hf:DIR` records
    assert model_config_for(model, own, 32, [tmp_path / "data"]).vocab_size == 8000


def test_an_hf_folder_without_a_tokenizer_is_said_to_be_unchecked(
    tmp_path, news_data, caplog
):
    from aisyn.data.shards import TokenShards
    from aisyn.train.models import model_config_for

    model = _qwen2_folder(tmp_path / "hf", with_tokenizer=False)
    tok = TokenShards.open(news_data, "train").tokenizer_info
    with caplog.at_level("WARNING", logger="aisyn.train"):
        model_config_for(model, tok, 32, [news_data])
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1
    assert "has no tokenizer.json" in warned[0] and str(news_data) in warned[0]

"""Hugging Face tokenizers (tokenizer.json) through prepare, reopen, streaming
detokenisation, train and generate."""

from __future__ import annotations

import json

import pytest

from aisyn.cli import main
from aisyn.data.detokenizer import REPLACEMENT, IncrementalDetokenizer
from aisyn.data.tokenizer import (
    HFTokenizer,
    PanguTokenizer,
    TokenizerError,
    load_tokenizer,
    open_tokenizer,
)

EOT, IM_END = "<|endoftext|>", "<|im_end|>"
TEXT = "新华社北京１月１日电 我们 hello\n鼗鼗𠀀。"  # rare characters: many bytes


def _train_byte_level_bpe(texts, vocab_size=500):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, news_corpus):
    """A GPT-2/Qwen2-style byte-level BPE (vocab 500) trained on 300 news
    documents, saved as save_pretrained would: tokenizer.json +
    tokenizer_config.json."""
    out = tmp_path_factory.mktemp("hf_tok")
    tok = _train_byte_level_bpe([d.text for d in news_corpus.documents[:300]])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "eos_token": {"content": EOT, "special": True},
                "pad_token": None,
            }
        )
    )
    return out


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory, hf_dir):
    out = tmp_path_factory.mktemp("hf_data") / "data"
    argv = ["prepare", "--corpus", "news", "--tokenizer", f"hf:{hf_dir}"]
    assert main([*argv, "--max-docs", "50", "--seq-len", "32", "--out", str(out)]) == 0
    return out


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("aisyn: error:") and "\n" not in err
    return err


def test_round_trip_on_real_text(hf_dir, news_corpus):
    tok = load_tokenizer(f"hf:{hf_dir}")

    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 500
    assert tok.eod_id == tok.pad_id == tok.tk.token_to_id(EOT)
    info = tok.info()
    assert info["kind"] == "hf" and info["eod_id"] == tok.eod_id
    texts = [d.text for d in news_corpus.documents[1000:1020]] + [TEXT]
    batch = tok.encode_many(texts)
    assert batch == [tok.encode(t) for t in texts]
    for text, ids in zip(texts, batch, strict=True):
        assert tok.decode(ids) == text
    # No special token is added on encoding, none skipped on decoding.
    assert tok.decode([*tok.encode("新闻"), tok.eod_id]) == "新闻" + EOT
    # A .json path names the same tokenizer.
    assert load_tokenizer(hf_dir / "tokenizer.json").sha256 == tok.sha256


def test_end_of_text_token_is_found_in_order(tmp_path, hf_dir):
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    file = tmp_path / "tokenizer.json"
    eot = HFTokenizer(file).tk.token_to_id(EOT)
    im_end = HFTokenizer(file).tk.token_to_id(IM_END)

    # Nothing beside it: the first known end-of-text name in the vocabulary.
    assert HFTokenizer(file).eod_id == eot
    # A model's config.json: its eos_token_id (a list: the first).
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [im_end, 0]}))
    assert HFTokenizer(file).eod_id == im_end
    # tokenizer_config.json's eos_token (a string here) wins; pad is its own.
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOT, "pad_token": IM_END})
    )
    tok = HFTokenizer(file)
    assert (tok.eod_id, tok.pad_id) == (eot, im_end)


def test_prepare_records_an_hf_tokenizer_and_its_copy_reopens(hf_dir, hf_data):
    tok = load_tokenizer(f"hf:{hf_dir}")
    manifest = json.loads((hf_data / "manifest.json").read_text())

    info = manifest["tokenizer"]
    assert info["kind"] == "hf"
    assert info["eod_id"] == tok.tk.token_to_id(EOT) == tok.eod_id
    assert info["sha256"] == tok.sha256 and info["vocab_size"] == 500
    copy = hf_data / info["file"]
    assert copy.name == "tokenizer.model"  # the same layout for both kinds

    for reopened in (open_tokenizer(copy, info), open_tokenizer(copy)):
        assert isinstance(reopened, HFTokenizer)
        assert reopened.info() == {k: v for k, v in info.items() if k != "file"}
        assert reopened.decode(reopened.encode(TEXT)) == TEXT
    # The recorded ids win over the names in the vocabulary.
    im_end = tok.tk.token_to_id(IM_END)
    recorded = {**info, "eod_id": im_end, "pad_id": im_end}
    assert open_tokenizer(copy, recorded).eod_id == im_end
    # As a --tokenizer value, the copy is the same tokenizer too.
    assert load_tokenizer(copy).info() == tok.info()


def test_pangu_copies_still_open_as_pangu(news_data, tokenizer):
    copy = news_data / "tokenizer.model"
    reopened = open_tokenizer(copy)

    assert isinstance(reopened, PanguTokenizer)
    assert reopened.info() == tokenizer.info()  # no "kind": old sha256 checks hold
    assert "kind" not in tokenizer.info()


def test_missing_tokenizer_json_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(f"hf:{tmp_path}")

    argv = ["prepare", "--corpus", "news", "--tokenizer", f"hf:{tmp_path}"]
    assert main([*argv, "--max-docs", "5", "--out", str(tmp_path / "x")]) == 2
    err = _one_line_error(capsys)
    assert f"{tmp_path}: no tokenizer.json" in err
    assert not (tmp_path / "x").exists()


def test_tokenizer_without_end_of_text_is_one_line(tmp_path, capsys):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"[UNK]": 0, "新": 1}, unk_token="[UNK]")).save(
        str(tmp_path / "tokenizer.json")
    )
    with pytest.raises(TokenizerError, match="no end-of-text token"):
        load_tokenizer(f"hf:{tmp_path}")

    argv = ["prepare", "--corpus", "news", "--tokenizer", f"hf:{tmp_path}"]
    assert main([*argv, "--max-docs", "5", "--out", str(tmp_path / "x")]) == 2
    assert "no end-of-text token" in _one_line_error(capsys)


def test_a_corrupt_tokenizer_json_is_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(f"hf:{tmp_path}")
    assert "not a Hugging Face tokenizer.json" in str(e.value)
    assert "\n" not in str(e.value)


def test_streaming_byte_level_tokens_gives_whole_characters(hf_dir, news_corpus):
    tok = load_tokenizer(f"hf:{hf_dir}")
    text = news_corpus.documents[2000].text[:300] + TEXT
    ids = tok.encode(text)
    # A 500-piece byte-level vocabulary cuts most Chinese characters in bytes.
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)

    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())

    assert "".join(pieces) == tok.decode(ids) == text
    assert not any(REPLACEMENT in p for p in pieces)
    assert sum(p == "" for p in pieces) > 5  # held back until complete


def test_streaming_an_unfinished_character_flushes_it(hf_dir):
    tok = load_tokenizer(f"hf:{hf_dir}")
    ids = tok.encode("𠀀")  # four bytes, none merged in a news-trained BPE
    detok = IncrementalDetokenizer(tok)

    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush().endswith(REPLACEMENT)


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_train_and_generate_on_hf_tokenized_data(model, tmp_path, hf_data, capsys):
    from aisyn.eval.generate import load_generator

    run = tmp_path / "run"
    argv = ["train", "--model", model, "--data", str(hf_data)]
    argv += ["--out", str(run), "--steps", "2", "--batch-size", "2"]
    assert main([*argv, "--device", "cpu", "--quiet"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["tokenizer"]["kind"] == "hf"
    assert config["model"]["vocab_size"] == 500
    capsys.readouterr()

    argv = ["generate", "--run", str(run), "--prompt", "新闻"]
    assert main([*argv, "--max-new-tokens", "5", "--device", "cpu"]) == 0
    out = capsys.readouterr().out

    gen = load_generator(run, "cpu")
    assert isinstance(gen.tokenizer, HFTokenizer)
    assert gen.tokenizer.eod_id == config["tokenizer"]["eod_id"]
    assert out == gen.complete("新闻", 5) + "\n"


def test_streaming_keeps_the_spaces_of_a_llama2_style_decoder(tmp_path):
    """Llama-2-style tokenizers (▁ word starts, byte fallback) strip the first
    space decoded, so a streamed token is decoded after the ones before it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>", *bytes_], show_progress=False
    )
    tok.train_from_iterator(["hello world of news", "the world says hello"], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    llama2 = load_tokenizer(tmp_path / "tokenizer.json")
    assert llama2.eod_id == tok.token_to_id("</s>")

    text = "hello world says 新闻 of the news"
    ids = llama2.encode(text)
    detok = IncrementalDetokenizer(llama2)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())

    assert llama2.decode(ids) == text
    assert "".join(pieces) == text
    assert not any(REPLACEMENT in p for p in pieces)


def test_convert_takes_an_hf_tokenizer_under_a_padded_embedding(tmp_path, hf_dir):
    """Hugging Face models may have more embedding rows than tokens (Qwen2);
    never fewer. A PanGu tokenizer must still match exactly."""
    from aisyn.convert import write_base
    from aisyn.model.families import load_config

    tok = load_tokenizer(f"hf:{hf_dir}")
    cfg = load_config("llama-tiny", vocab_size=512)
    write_base(tmp_path / "run", cfg, {}, tok, {"format": "test"})
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["tokenizer"] == tok.info()
    assert open_tokenizer(tmp_path / "run" / "tokenizer.model").info() == tok.info()

    with pytest.raises(ValueError, match="500 pieces, but .* 400 rows"):
        write_base(
            tmp_path / "small", load_config("llama-tiny", vocab_size=400), {}, tok, {}
        )
    pangu = load_tokenizer(None)
    with pytest.raises(ValueError, match="8000 pieces, but .* 8192 rows"):
        write_base(
            tmp_path / "pangu", load_config("tiny", vocab_size=8192), {}, pangu, {}
        )


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_generate_from_an_hf_folder_equals_transformers_greedy(
    family, hf_dir, tmp_path, capsys
):
    """``aisyn generate --model hf:DIR`` reads the folder's weights and its
    tokenizer.json; greedy, it writes exactly the tokens transformers'
    ``generate`` picks."""
    import shutil

    import torch

    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "hf"
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / f, folder / f)
    kw = dict(
        vocab_size=500,
        max_position_embeddings=64,
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
    )
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=500, n_positions=64, n_layer=2, n_embd=32, n_head=4
        )
    else:
        cfg = transformers.Qwen2Config(num_key_value_heads=2, **kw)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ref.save_pretrained(folder)
    prompt = "新华社北京"
    argv = ["generate", "--model", f"hf:{folder}", "--prompt", prompt]
    assert main([*argv, "--max-new-tokens", "12", "--device", "cpu"]) == 0
    ours = capsys.readouterr().out.rstrip("\n")

    tok = load_tokenizer(f"hf:{folder}")
    ids = torch.tensor([tok.tk.encode(prompt, add_special_tokens=True).ids])
    with torch.no_grad():
        out = ref.generate(
            ids,
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=tok.eod_id,
            pad_token_id=tok.eod_id,
        )
    new = [t for t in out[0, ids.shape[1] :].tolist()]
    if tok.eod_id in new:
        new = new[: new.index(tok.eod_id)]
    assert ours == tok.decode(new)
    assert ours  # a random model still writes something


def test_generate_needs_run_or_model_not_both(hf_dir, tmp_path, capsys):
    assert main(["generate", "--prompt", "x"]) == 2
    assert "give --run RUN or --model hf:DIR" in _one_line_error(capsys)
    assert main(["generate", "--model", "tiny", "--prompt", "x"]) == 2
    assert "give hf:DIR" in _one_line_error(capsys)

"""Model folders, configs and other files from elsewhere, malformed or hostile,
end in one line naming the problem (exit 2), never a traceback, a run that
grows for minutes, or a model that prints garbage with exit 0 (issue 17,
items 12-14). Each case mutates one small real folder written here; commands
run in-process (``main(argv)``) to keep this fast.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from aisyn.cli import main
from aisyn.model.families import build_model
from aisyn.model.hf import HFConfig, write_hf_folder
from aisyn.model.pangu import PanguConfig
from aisyn.model.port import write_port_folder

DEEP = "[" * 100_000 + "]" * 100_000  # deeper than Python's parser recurses
EOT = "<|endoftext|>"


def _tokenizer_json(out) -> None:
    """A byte-level BPE of ~270 tokens (fits the folders' 320-row embedding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=270,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["新华社北京电 hello world"] * 20, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOT}))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A two-layer Llama folder as save_pretrained writes it, with its
    tokenizer: the well-formed original every case below breaks one way."""
    out = tmp_path_factory.mktemp("llama")
    cfg = HFConfig(
        family="llama",
        vocab_size=320,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_size=64,
        seq_len=64,
    )
    write_hf_folder(cfg, build_model(cfg, seed=1).state_dict(), out)
    _tokenizer_json(out)
    return out


@pytest.fixture(scope="module")
def port_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("port")
    cfg = PanguConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        ffn_size=64,
        seq_len=16,
    )
    write_port_folder(cfg, build_model(cfg, seed=1).state_dict(), out)
    return out


def _config(folder, **changes):
    path = folder / "config.json"
    c = json.loads(path.read_text())
    c.update(changes)
    path.write_text(json.dumps(c))


def _weights(folder, change):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def _sharded(folder, index):
    (folder / "model.safetensors").rename(folder / "model-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(index)


def _nan(tensors):
    tensors["model.norm.weight"] = torch.full_like(
        tensors["model.norm.weight"], float("nan")
    )


def _int64(tensors):
    w = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = w.to(torch.int64)


# (id, which folder, how to break it, what the one line must say)
HF_CASES = [
    ("config-deep", lambda d: (d / "config.json").write_text(DEEP), "nested deeper"),
    (
        "config-nan",
        lambda d: (d / "config.json").write_text('{"model_type": "llama", "x": NaN}'),
        "NaN is not a JSON number",
    ),
    ("config-list", lambda d: (d / "config.json").write_text("[1]"), "JSON object"),
    (
        "config-huge",
        lambda d: (d / "config.json").write_bytes(b" " * (17 * 2**20)),
        "larger than any JSON file",
    ),
    ("rope-scaling-list", lambda d: _config(d, rope_scaling=[1]), "rope_scaling must"),
    ("rope-params-str", lambda d: _config(d, rope_parameters="x"), "rope_parameters"),
    ("head-dim-negative", lambda d: _config(d, head_dim=-8), "head_dim must be"),
    ("heads-zero", lambda d: _config(d, num_attention_heads=0), "num_heads must"),
    ("heads-string", lambda d: _config(d, num_attention_heads="4"), "must be an int"),
    ("eps-negative", lambda d: _config(d, rms_norm_eps=-1), "norm_eps must be"),
    (
        "layers-1e9",
        lambda d: _config(d, num_hidden_layers=10**9),
        "num_hidden_layers 1000000000, but the weights hold 2 layers",
    ),
    (
        "vocab-1e9",
        lambda d: _config(d, vocab_size=10**9),
        "config.json does not describe the weights",
    ),
    (
        "ffn-wrong",
        lambda d: _config(d, intermediate_size=10**6),
        "first block's model.layers.0.mlp",
    ),
    ("weights-nan", lambda d: _weights(d, _nan), "non-finite values"),
    ("weights-int64", lambda d: _weights(d, _int64), "is int64, not floating"),
    (
        "tokenizer-config-deep",
        lambda d: (d / "tokenizer_config.json").write_text(DEEP),
        "nested deeper",
    ),
    ("index-deep", lambda d: _sharded(d, DEEP), "nested deeper"),
    (
        "index-weight-map-list",
        lambda d: _sharded(d, '{"weight_map": ["model-00001.safetensors"]}'),
        "no weight_map object",
    ),
    (
        "index-weight-map-path",
        lambda d: _sharded(d, '{"weight_map": {"a": "../model.safetensors"}}'),
        "is not a file name",
    ),
]


def _run(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.err


@pytest.mark.parametrize(
    ("breaks", "expected"),
    [pytest.param(b, e, id=name) for name, b, e in HF_CASES],
)
def test_a_broken_hf_folder_is_one_line(breaks, expected, llama_dir, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(llama_dir, folder)
    breaks(folder)
    start = time.monotonic()
    argv = ["generate", "--model", f"hf:{folder}", "--prompt", "hello"]
    code, err = _run([*argv, "--max-new-tokens", "2"], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err
    assert time.monotonic() - start < 10  # refused, not built


def test_the_unbroken_folder_generates(llama_dir, capsys):
    """The cases' original passes every check (so each case fails for its
    one change)."""
    argv = ["generate", "--model", f"hf:{llama_dir}", "--prompt", "hello"]
    code, err = _run([*argv, "--max-new-tokens", "2"], capsys)
    assert code == 0, err


PORT_CASES = [
    (
        "eps-negative",
        dict(layer_norm_epsilon=-1),
        "layer_norm_eps must be a positive number",
    ),
    ("eps-string", dict(layer_norm_epsilon="1e-5"), "layer_norm_epsilon must be a"),
    (
        "positions-30000",
        dict(max_position_embeddings=30_000),
        "transformer.wpe.weight is (16, 32) in the file, the config makes it "
        "(30000, 32)",
    ),
    (
        "layers-1e6",
        dict(num_layers=10**6),
        "num_layers 1000000, but the weights hold 2 layers",
    ),
    ("heads-zero", dict(num_heads=0), "num_heads must be positive"),
    ("activation-list", dict(activation_function=["gelu"]), "must be a string"),
]


@pytest.mark.parametrize(
    ("changes", "expected"),
    [pytest.param(c, e, id=name) for name, c, e in PORT_CASES],
)
def test_a_broken_port_folder_is_one_line(
    changes, expected, port_dir, tmp_path, capsys
):
    folder = tmp_path / "port"
    shutil.copytree(port_dir, folder)
    _config(folder, **changes)
    out = tmp_path / "run"
    code, err = _run(
        ["convert", "--from", "pangu-port", str(folder), "--out", str(out)], capsys
    )
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err
    assert not out.exists()  # nothing half-written


def test_the_unbroken_port_folder_converts(port_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code, err = _run(
        ["convert", "--from", "pangu-port", str(port_dir), "--out", str(out)], capsys
    )
    assert code == 0, err


MODEL_FILE_CASES = [
    ("deep", DEEP, "nested deeper"),
    ("infinity", '{"hidden_size": 1e400}', "out of range"),
    (
        "layers-1e7",
        json.dumps(dict(hidden_size=8, num_heads=1, ffn_size=8, num_layers=10**7)),
        "num_layers 10000000 is more than any model has",
    ),
    ("hidden-2e40", json.dumps(dict(hidden_size=2**40, num_heads=1)), "hidden_size"),
    (
        "parameters-1e20",
        json.dumps(dict(hidden_size=2**30, num_heads=1, ffn_size=2**30)),
        "parameters is larger than any (1.13e+15 at most); lower num_layers",
    ),
    ("heads-zero", json.dumps(dict(num_heads=0)), "num_heads must be positive"),
    ("eps-negative", json.dumps(dict(layer_norm_eps=-1.0)), "layer_norm_eps must"),
]


@pytest.mark.parametrize(
    ("text", "expected"),
    [pytest.param(t, e, id=name) for name, t, e in MODEL_FILE_CASES],
)
def test_a_broken_model_file_is_one_line(text, expected, tmp_path, capsys):
    path = tmp_path / "model.json"
    path.write_text(text)
    start = time.monotonic()
    plan = ["split", "plan", "--model", str(path), "--party", "A:1:32GB"]
    code, err = _run([*plan, "--party", "B:4:80GB"], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err
    assert time.monotonic() - start < 10


def test_a_config_alone_is_weighed_against_free_memory(monkeypatch):
    """Built for real (not on meta), a model must fit its fp32 weights in the
    memory that is free; the line names the field to lower."""
    from aisyn.model import capacity

    cfg = PanguConfig(
        vocab_size=64, hidden_size=64, num_layers=2000, num_heads=4, ffn_size=64
    )
    monkeypatch.setattr(capacity, "available_bytes", lambda device: 2**20)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"only 1\.00 MiB is free; lower num_layers"):
        build_model(cfg)
    assert time.monotonic() - start < 1  # weighed, not built
    capacity.check_buildable(cfg, meta=True)  # meta allocates no weights
    monkeypatch.setenv(capacity.SKIP_ENV, "1")
    capacity.check_buildable(cfg, meta=False)


@pytest.mark.parametrize(
    "cfg",
    [
        PanguConfig(vocab_size=100, hidden_size=48, num_layers=3, num_heads=4),
        HFConfig(family="gpt2", vocab_size=100, hidden_size=32, num_layers=3),
        HFConfig(family="llama", vocab_size=100, hidden_size=32, head_dim=16),
        HFConfig(family="qwen2", vocab_size=100, tie_embeddings=True, num_kv_heads=2),
        HFConfig(family="llama", attention_bias=True, mlp_bias=True),
    ],
    ids=lambda c: c.family,
)
def test_parameter_count_is_the_built_models(cfg):
    assert cfg.parameter_count() == build_model(cfg, device="meta").num_parameters()


def test_a_cpu_allocation_failure_is_out_of_memory_not_a_traceback(monkeypatch, capsys):
    """torch's CPU allocator raises a plain RuntimeError, not OutOfMemoryError."""
    import aisyn.cli

    def allocate(args):
        torch.empty(2**62, dtype=torch.uint8)

    monkeypatch.setattr(aisyn.cli, "cmd_demo", allocate)
    code = main(["demo"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("aisyn: error: out of memory")


def test_the_json_reader_counts_nesting_not_brackets_in_strings(tmp_path):
    from aisyn.validate import MAX_JSON_DEPTH, parse_json, read_json

    inside = '{"a": "' + "[[[[{{{{" * 40 + '\\"", "b": ["中[文"]}'
    assert parse_json(inside, "x")["b"] == ["中[文"]
    deepest = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json(deepest, "x") is not None
    with pytest.raises(ValueError, match="x: nested deeper than 32 levels"):
        parse_json("[" + deepest + "]", "x")
    path = tmp_path / "c.json"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}')  # a BOM, as some editors write
    assert read_json(path) == {"a": 1}
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError, match="c.json: not valid JSON"):
        read_json(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (DEEP, "corrupt run config: "),
        ("[1, 2]", "must be a JSON object, got list"),
    ],
)
def test_a_broken_run_config_is_one_line(text, expected, tmp_path, capsys):
    """A base run may come from another organisation: its config.json is read
    with the same bounds."""
    (tmp_path / "config.json").write_text(text)
    code, err = _run(["generate", "--run", str(tmp_path), "--prompt", "x"], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err

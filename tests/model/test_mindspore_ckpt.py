"""MindSpore .ckpt files: read, written and converted without MindSpore.

The fixtures were written by MindSpore 2.10.0 itself
(tests/fixtures/mindspore/make_fixtures.py); weights.npz holds their arrays.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from aisyn.cli import main
from aisyn.convert import convert_from_mindspore
from aisyn.model.mindspore_ckpt import (
    MindSporeCheckpointError,
    read_checkpoint,
    write_checkpoint,
)
from aisyn.model.mindspore_pangu import (
    gather_weights,
    infer_config,
    to_mindspore,
    to_state_dict,
)
from aisyn.model.pangu import CONFIGS, PanguAlpha, PanguConfig, fast_gelu
from aisyn.model.port import PortError, read_port_config, write_port_folder
from aisyn.model.proto.mindspore_checkpoint_pb2 import Checkpoint
from aisyn.train.checkpoint import load_weights
from aisyn.train.models import load_run_model
from aisyn.train.run import RunDir

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests/fixtures/mindspore"
SPLIT = [FIXTURES / f"split_{p}.ckpt" for p in ("embedding", "backbone", "head")]


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "weights.npz", allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def model_from(files: list[Path]) -> PanguAlpha:
    entries = {str(f): read_checkpoint(f) for f in files}
    weights = gather_weights(entries)
    cfg = infer_config(weights, num_heads=2)
    model = PanguAlpha(cfg)
    load_weights(model, to_state_dict(weights, cfg), "fixture")
    return model.eval()


# --- the format -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["plain", "chunked", "crc", "training"])
def test_mindspore_files_read_exactly(name, expected):
    tensors = read_checkpoint(FIXTURES / f"{name}.ckpt")
    for key, array in expected.items():
        assert tensors[key].dtype == torch.float32
        np.testing.assert_array_equal(tensors[key].numpy(), array)


def test_chunked_fixture_really_is_chunked():
    # MindSpore wrote the word embedding (2 560 bytes) as 1 KiB slices
    data = (FIXTURES / "chunked.ckpt").read_bytes()
    assert data.count(b"backbone.embedding.word_embedding.embedding_table") == 3


def test_training_state_and_metadata_are_read_too():
    tensors = read_checkpoint(FIXTURES / "training.ckpt")
    assert tensors["global_step"].tolist() == [10]
    assert tensors["step_num"].item() == 10  # a scalar
    assert tensors["note"] == "tiny PanGu fixture"


def test_our_writer_writes_mindspore_bytes(expected, tmp_path):
    tensors = {k: torch.from_numpy(v) for k, v in expected.items()}
    write_checkpoint(tmp_path / "plain.ckpt", tensors)
    write_checkpoint(tmp_path / "crc.ckpt", tensors, crc=True)
    for name in ("plain", "crc"):
        ours = (tmp_path / f"{name}.ckpt").read_bytes()
        assert ours == (FIXTURES / f"{name}.ckpt").read_bytes()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64]
)
def test_writer_chunks_and_reader_joins(dtype, tmp_path):
    t = (torch.arange(7 * 5 * 3).reshape(7, 5, 3) - 40).to(dtype)
    scalar = torch.tensor(3.5, dtype=torch.float32)
    path = tmp_path / "x.ckpt"
    write_checkpoint(path, {"big": t, "s": scalar}, slice_bytes=40, crc=True)
    assert path.read_bytes().count(b"big") > 3  # written as several values
    back = read_checkpoint(path)
    assert back["big"].dtype == dtype and torch.equal(back["big"], t)
    assert back["s"].shape == () and back["s"].item() == 3.5


# --- bad files: one clear line each ---------------------------------------------------


def damaged(tmp_path, name: str, change) -> Path:
    data = bytearray((FIXTURES / "plain.ckpt").read_bytes())
    path = tmp_path / name
    path.write_bytes(bytes(change(data)))
    return path


def test_truncated_file(tmp_path):
    path = damaged(tmp_path, "cut.ckpt", lambda d: d[: len(d) - 100])
    with pytest.raises(MindSporeCheckpointError, match="truncated"):
        read_checkpoint(path)


def test_crc_mismatch(tmp_path):
    data = bytearray((FIXTURES / "crc.ckpt").read_bytes())
    data[500] ^= 0x01  # one bit inside a tensor's content
    path = tmp_path / "flipped.ckpt"
    path.write_bytes(bytes(data))
    with pytest.raises(MindSporeCheckpointError, match="CRC mismatch .* damaged"):
        read_checkpoint(path)


def test_encrypted_file_is_refused():
    with pytest.raises(MindSporeCheckpointError, match=r"encrypted \(AES-GCM\)"):
        read_checkpoint(FIXTURES / "encrypted.ckpt")


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "empty file"),
        (b"PK\x03\x04 a zip, or anything else", "not a MindSpore checkpoint"),
        (b"\n\x03abc", "not a MindSpore checkpoint"),
    ],
)
def test_not_a_checkpoint(content, message, tmp_path):
    path = tmp_path / "x.ckpt"
    path.write_bytes(content)
    with pytest.raises(MindSporeCheckpointError, match=message):
        read_checkpoint(path)


def test_missing_tensor_names_it():
    entries = {"head": read_checkpoint(SPLIT[2]), "body": read_checkpoint(SPLIT[1])}
    with pytest.raises(ValueError, match="missing tensor backbone.embedding.word_emb"):
        infer_config(gather_weights(entries), num_heads=2)
    entries["emb"] = read_checkpoint(SPLIT[0])
    weights = gather_weights(entries)
    del weights["blocks.1.output.mapping.bias"]
    with pytest.raises(ValueError, match=r"missing tensor backbone.blocks.1.output"):
        to_state_dict(weights, infer_config(weights, num_heads=2))


def test_wrong_shape_names_it():
    weights = gather_weights({"f": read_checkpoint(FIXTURES / "plain.ckpt")})
    weights["blocks.0.attention.dense2.bias"] = torch.zeros(9)
    with pytest.raises(ValueError, match=r"dense2.bias has shape \(9,\), expected"):
        to_state_dict(weights, infer_config(weights, num_heads=2))


def test_unknown_tensor_and_duplicates_are_refused():
    plain = read_checkpoint(FIXTURES / "plain.ckpt")
    with pytest.raises(ValueError, match="backbone.extra is not a PanGu-α param"):
        gather_weights({"f": {**plain, "backbone.extra": torch.zeros(3)}})
    with pytest.raises(ValueError, match="is also in"):
        gather_weights({"a": plain, "b": read_checkpoint(SPLIT[0])})


def test_heads_cannot_be_guessed_for_an_unknown_size():
    weights = gather_weights({"f": read_checkpoint(FIXTURES / "plain.ckpt")})
    with pytest.raises(ValueError, match="pass --num-heads"):
        infer_config(weights)


# --- the model ------------------------------------------------------------------------


def test_weights_land_where_pangu_uses_them(expected):
    model = model_from([FIXTURES / "plain.ckpt"])
    sd = model.state_dict()
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_size) == (3, 8, 32)
    assert (cfg.vocab_size, cfg.seq_len) == (80, 8)

    def same(ours, theirs, transpose=False):
        want = torch.from_numpy(expected[theirs])
        assert torch.equal(sd[ours], want.T if transpose else want), ours

    same("transformer.wte.weight", "backbone.embedding.word_embedding.embedding_table")
    same("lm_head.weight", "backbone.embedding.word_embedding.embedding_table")
    same("transformer.wqe.weight", "backbone.top_query_embedding.embedding_table")
    same("transformer.ln_f.weight", "backbone.layernorm.gamma")
    same(
        "transformer.h.1.attn.k_proj.weight",
        "backbone.blocks.1.attention.dense2.weight",
    )
    # stored [in, out] by MindSpore (transpose_b=False): transposed
    same(
        "transformer.h.0.attn.c_proj.weight",
        "backbone.blocks.0.attention.projection.weight",
        transpose=True,
    )
    same(
        "transformer.h.2.mlp.c_fc.weight",
        "backbone.top_query_layer.output.mapping.weight",
        transpose=True,
    )
    same(
        "transformer.h.2.mlp.c_proj.bias",
        "backbone.top_query_layer.output.projection.bias",
    )


def test_split_files_make_the_same_model():
    whole = model_from([FIXTURES / "plain.ckpt"]).state_dict()
    split = model_from(SPLIT).state_dict()
    assert all(torch.equal(whole[k], split[k]) for k in whole)


def test_training_checkpoint_loads_ignoring_optimizer_state():
    whole = model_from([FIXTURES / "plain.ckpt"]).state_dict()
    trained = model_from([FIXTURES / "training.ckpt"]).state_dict()
    assert all(torch.equal(whole[k], trained[k]) for k in whole)


def test_round_trip_ours_to_ckpt_to_ours_is_bit_exact(tmp_path):
    model = PanguAlpha(
        infer_config(
            gather_weights({"f": read_checkpoint(FIXTURES / "plain.ckpt")}), num_heads=2
        ),
        seed=7,
    )
    cfg = model.config
    write_checkpoint(tmp_path / "m.ckpt", to_mindspore(model.state_dict(), cfg))
    back = model_from([tmp_path / "m.ckpt"])
    for name, t in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


# --- aisyn convert --------------------------------------------------------------------


def test_convert_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "base"
    argv = ["convert", "--from", "mindspore", *map(str, SPLIT), "--out", str(out)]
    assert main([*argv, "--num-heads", "2"]) == 0
    assert "3 layers, hidden 8, 2 heads" in capsys.readouterr().out

    loaded, config = load_run_model(out)
    direct = model_from([FIXTURES / "plain.ckpt"])
    tokens = torch.tensor([[1, 5, 79, 0, 33, 2, 8, 60]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens), direct(tokens))
    assert config["kind"] == "converted"

    # and back: the same bytes MindSpore wrote for the same weights, with CRC
    back = tmp_path / "back.ckpt"
    argv = ["convert", "--to", "mindspore", "--run", str(out), "--out", str(back)]
    assert main([*argv, "--crc"]) == 0
    again = read_checkpoint(back)
    for name, t in read_checkpoint(FIXTURES / "crc.ckpt").items():
        assert torch.equal(again[name], t), name


def test_failed_convert_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "base"
    argv = ["convert", "--from", "mindspore", str(SPLIT[1]), str(SPLIT[2])]
    assert main([*argv, "--out", str(out), "--num-heads", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing tensor" in err[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--from", "mindspore", "--out", "x"], "give one or more .ckpt files"),
        (["--to", "mindspore", "--out", "x.ckpt"], "give --run RUN"),
        (["--from", "mindspore", "nope.ckpt", "--out", "x"], "nope.ckpt: no such file"),
        (["--from", "tensorflow", "--out", "x"], "invalid choice"),
        (
            [
                f"{FIXTURES}/plain.ckpt",
                "--from",
                "mindspore",
                "--out",
                "x",
                "--dtype",
                "fp16",
            ],
            "--dtype go with --to",
        ),
        (
            ["--to", "mindspore", "--run", "r", "--out", "x", "--strategy", __file__],
            "no files, --tokenizer, --num-heads or --strategy",
        ),
        (["--to", "mindspore", "--out", "x", "--dtype", "fp8"], "invalid choice"),
        (
            ["--to", "hf", "--run", "r", "--out", "x", "--dtype", "fp16"],
            "go with --to mindspore",
        ),
        (["--out", "x"], "one of the arguments --from --to is required"),
        (
            [
                f"{FIXTURES}/plain.ckpt",
                "--from",
                "mindspore",
                "--out",
                "x",
                "--num-heads",
                "0",
            ],
            "must be",
        ),
    ],
)
def test_convert_flags_are_checked(argv, message, capsys):
    try:
        code = main(["convert", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


# --- the generated protobuf module ----------------------------------------------------


def test_regenerating_the_mindspore_proto_is_a_no_op(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["bash", str(REPO / "scripts/gen_mindspore_proto.sh"), str(tmp_path)],
        check=True,
        env=env,
        capture_output=True,
        timeout=60,
    )
    generated = REPO / "src/aisyn/model/proto"
    for name in (
        f"mindspore_{proto}_pb2.{ext}"
        for proto in ("checkpoint", "strategy")
        for ext in ("py", "pyi")
    ):
        assert (tmp_path / name).read_bytes() == (generated / name).read_bytes(), (
            f"{name} is stale: run scripts/gen_mindspore_proto.sh"
        )


# --- what the converted model computes ------------------------------------------------


def reference_logits(w: dict[str, np.ndarray], tokens: list[int], heads: int):
    """MindSpore's PanGu-α forward pass in NumPy (float64), read off the
    official model's cells, on the checkpoint's own names and layouts (dense1/2/3
    [out, in], the projections and FFN [in, out]); shares no code with ours."""

    def ln(x, prefix):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w[f"{prefix}.gamma"] + w[
            f"{prefix}.beta"
        ]

    def layer(x, prefix, query=None):
        h = ln(x, f"{prefix}.layernorm1")
        q_in = h if query is None else query  # the top query layer: wqe
        a = f"{prefix}.attention"
        q = q_in @ w[f"{a}.dense1.weight"].T + w[f"{a}.dense1.bias"]
        k = h @ w[f"{a}.dense2.weight"].T + w[f"{a}.dense2.bias"]
        v = h @ w[f"{a}.dense3.weight"].T + w[f"{a}.dense3.bias"]
        T, C = h.shape
        d = C // heads
        q, k, v = (t.reshape(T, heads, d).transpose(1, 0, 2) for t in (q, k, v))
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(d)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        y = (p @ v).transpose(1, 0, 2).reshape(T, C)
        x = x + y @ w[f"{a}.projection.weight"] + w[f"{a}.projection.bias"]
        h = ln(x, f"{prefix}.layernorm2")
        o = f"{prefix}.output"
        m = h @ w[f"{o}.mapping.weight"] + w[f"{o}.mapping.bias"]
        m = m / (1 + np.exp(-1.702 * m))  # MindSpore's fast_gelu
        return x + m @ w[f"{o}.projection.weight"] + w[f"{o}.projection.bias"]

    w = {k: v.astype(np.float64) for k, v in w.items()}
    word = w["backbone.embedding.word_embedding.embedding_table"]
    pos = np.arange(len(tokens))
    x = word[tokens] + w["backbone.embedding.position_embedding.embedding_table"][pos]
    for i in range(2):
        x = layer(x, f"backbone.blocks.{i}")
    x = ln(x, "backbone.layernorm")
    query = w["backbone.top_query_embedding.embedding_table"][pos]
    x = layer(x, "backbone.top_query_layer", query)
    return x @ word.T


def test_converted_model_computes_what_mindspore_does(expected, tmp_path):
    out = tmp_path / "base"
    argv = ["convert", "--from", "mindspore", str(FIXTURES / "plain.ckpt")]
    assert main([*argv, "--out", str(out), "--num-heads", "2"]) == 0
    model, config = load_run_model(out)
    assert config["model"]["activation"] == "fast_gelu"  # recorded by convert
    tokens = [1, 5, 79, 0, 33, 2, 8, 60]
    want = reference_logits(expected, tokens, heads=2)
    with torch.no_grad():
        got = model(torch.tensor([tokens]))[0].double().numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

    # the exact GELU on the same weights computes something else
    gelu = PanguAlpha(replace(model.config, activation="gelu"))
    load_weights(gelu, model.state_dict(), "same weights")
    with torch.no_grad():
        other = gelu(torch.tensor([tokens]))[0].double().numpy()
    assert np.abs(other - want).max() > 1e-2


def test_fast_gelu_is_mindspores():
    x = torch.linspace(-6, 6, 101, dtype=torch.float64)
    assert torch.allclose(fast_gelu(x), x / (1 + torch.exp(-1.702 * x)))


def test_activation_config_field():
    # an old config.json (no field) is GELU, and its dict stays as it was
    old = dict(CONFIGS["tiny"])
    cfg = PanguConfig.from_dict(old)
    assert cfg.activation == "gelu" and "activation" not in cfg.to_dict()
    assert cfg.to_dict() == {**PanguConfig(**old).to_dict()}
    fast = PanguConfig.from_dict({**old, "activation": "fast_gelu"})
    assert fast.to_dict()["activation"] == "fast_gelu"
    assert PanguConfig.from_dict(fast.to_dict()) == fast
    with pytest.raises(ValueError, match="activation must be one of gelu, fast_gelu"):
        PanguConfig.from_dict({**old, "activation": "relu"})
    with pytest.raises(ValueError, match="activation must be a string, got 1"):
        PanguConfig.from_dict({**old, "activation": 1})
    # presets and every model built from them stay on the exact GELU
    assert PanguAlpha(cfg).transformer.h[0].mlp.act is torch.nn.functional.gelu
    assert PanguAlpha(fast).transformer.h[0].mlp.act is fast_gelu


def test_port_export_keeps_the_activation(tmp_path):
    fast = PanguConfig.from_dict({**CONFIGS["tiny"], "activation": "fast_gelu"})
    model = PanguAlpha(fast)
    write_port_folder(fast, model.state_dict(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["activation_function"] == "quick_gelu"  # x * sigmoid(1.702 x)
    assert read_port_config(tmp_path) == fast
    for bad, why in (
        ("relu", "not one of gelu, quick_gelu"),
        (["gelu"], "activation_function must be a string"),
    ):
        (tmp_path / "config.json").write_text(
            json.dumps({**config, "activation_function": bad})
        )
        with pytest.raises(PortError, match=why):
            read_port_config(tmp_path)


# --- other savers' names, loop state --------------------------------------------------

#: the three embeddings' names by saver (ours first); everything else as plain.ckpt's
EMBEDDING_NAMES = {
    "r1.3 model_zoo": (
        "embedding_table",
        "backbone.embedding.embedding.position_embedding.embedding_table",
        "backbone.top_query_embedding_table",
    ),
    "mindformers": (
        "backbone.word_embedding_table",
        "backbone.position_embedding_table",
        "backbone.query_embedding_table",
    ),
    "mindformers, bare": (
        "word_embedding_table",
        "position_embedding_table",
        "query_embedding_table",
    ),
}
OURS = (
    "backbone.embedding.word_embedding.embedding_table",
    "backbone.embedding.position_embedding.embedding_table",
    "backbone.top_query_embedding.embedding_table",
)


def renamed(tensors: dict, names: dict[str, str]) -> dict:
    return {names.get(k, k): v for k, v in tensors.items()}


@pytest.mark.parametrize("saver", list(EMBEDDING_NAMES))
def test_other_savers_embedding_names_load(saver, tmp_path):
    plain = read_checkpoint(FIXTURES / "plain.ckpt")
    theirs = renamed(plain, dict(zip(OURS, EMBEDDING_NAMES[saver], strict=True)))
    write_checkpoint(tmp_path / "m.ckpt", theirs)
    whole = model_from([FIXTURES / "plain.ckpt"]).state_dict()
    back = model_from([tmp_path / "m.ckpt"]).state_dict()
    assert all(torch.equal(whole[k], back[k]) for k in whole)


def test_r13_pipeline_model_keeps_its_top_layer_as_the_last_block(tmp_path):
    plain = read_checkpoint(FIXTURES / "plain.ckpt")
    top = "backbone.top_query_layer."
    pipeline = {
        (f"backbone.blocks.2.{k.removeprefix(top)}" if k.startswith(top) else k): v
        for k, v in plain.items()
    }
    pipeline = renamed(
        pipeline, dict(zip(OURS, EMBEDDING_NAMES["r1.3 model_zoo"], strict=True))
    )
    write_checkpoint(tmp_path / "m.ckpt", pipeline)
    whole = model_from([FIXTURES / "plain.ckpt"])
    back = model_from([tmp_path / "m.ckpt"])
    assert back.config == whole.config  # 3 layers: 2 blocks + the top query layer
    assert all(
        torch.equal(t, back.state_dict()[k]) for k, t in whole.state_dict().items()
    )


#: the loop state of the released 2.6B checkpoint, beside its weights
LOOP_STATE = {
    "has_trained_step": torch.tensor([1000], dtype=torch.int32),
    "cur_epoch_num": torch.tensor([1], dtype=torch.int32),
    "has_trained_epoch": torch.tensor([0], dtype=torch.int32),
    "data_start_index": torch.tensor([0], dtype=torch.int32),
    "cur_step_num": torch.tensor(1000, dtype=torch.int32),
    "loss_scale_value": torch.tensor(1024.0),
    "a_trainers_own_counter": torch.tensor(7, dtype=torch.int64),  # unknown, 0-d
}


def test_loop_state_is_skipped_and_reported(tmp_path, capsys):
    plain = read_checkpoint(FIXTURES / "plain.ckpt")
    moments = {f"adam_m.{k}": torch.zeros_like(v) for k, v in list(plain.items())[:2]}
    write_checkpoint(tmp_path / "m.ckpt", {**plain, **LOOP_STATE, **moments})
    out = tmp_path / "base"
    argv = ["convert", "--from", "mindspore", str(tmp_path / "m.ckpt")]
    assert main([*argv, "--out", str(out), "--num-heads", "2"]) == 0
    printed = capsys.readouterr().out
    assert "skipped training state: 9 entries: 2 adam_m.*; a_trainers_own" in printed
    res = convert_from_mindspore([tmp_path / "m.ckpt"], tmp_path / "again", num_heads=2)
    assert res["skipped"] == sorted([*LOOP_STATE, *moments])
    whole = model_from([FIXTURES / "plain.ckpt"]).state_dict()
    loaded, _ = load_run_model(out)
    assert all(torch.equal(whole[k], loaded.state_dict()[k]) for k in whole)


def test_unknown_tensor_of_several_elements_is_still_refused():
    plain = read_checkpoint(FIXTURES / "plain.ckpt")
    gather_weights({"f": {**plain, "backbone.counter": torch.zeros(1)}})  # skipped
    with pytest.raises(ValueError, match="backbone.extra is not a PanGu-α param"):
        gather_weights({"f": {**plain, "backbone.extra": torch.zeros(2)}})


# --- hostile files --------------------------------------------------------------------


def test_a_far_block_index_is_refused_before_anything_is_sized(tmp_path):
    plain = read_checkpoint(FIXTURES / "plain.ckpt")
    far = {**plain, "backbone.blocks.100000000.layernorm1.gamma": torch.ones(8)}
    write_checkpoint(tmp_path / "far.ckpt", far)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"blocks up to 100000000 but none of block 2"):
        infer_config(gather_weights({"f": read_checkpoint(tmp_path / "far.ckpt")}), 2)
    assert time.perf_counter() - start < 2  # was 151 s and 4.4 GB


def test_an_empty_tensor_declaring_a_huge_size_is_one_line(tmp_path, capsys):
    # no bytes behind it, so the reader takes it; the sizes it would set (an FFN
    # of 10^12) are checked against the other tensors before anything is built
    plain = read_checkpoint(FIXTURES / "plain.ckpt")
    name = "backbone.top_query_layer.output.mapping.weight"
    write_checkpoint(tmp_path / "x.ckpt", {**plain, name: torch.empty(0, 10**12)})
    argv = ["convert", "--from", "mindspore", str(tmp_path / "x.ckpt")]
    start = time.perf_counter()
    assert main([*argv, "--out", str(tmp_path / "o"), "--num-heads", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected (8, 1000000000000)" in err[0]
    assert time.perf_counter() - start < 2


def raw_value(tag: str, dims: list[int], kind: str, content: bytes) -> bytes:
    """One checkpoint value as MindSpore writes it, with any dims at all."""
    msg = Checkpoint()
    value = msg.value.add()
    value.tag, value.tensor.tensor_type = tag, kind
    value.tensor.dims.extend(dims)
    value.tensor.tensor_content = content
    return msg.SerializeToString()


@pytest.mark.parametrize(
    "dims, content, message",
    [
        ([-1, -8], b"\0" * 32, "negative shape"),
        ([-2, 4], b"", "negative shape"),
        ([2**32, 2**32], b"", "overflows 64 bits"),  # int64's product wraps to 0
        ([2**62, 4, 0], b"", "overflows 64 bits"),
        ([3, 2**40], b"\0" * 8, "needs"),
    ],
)
def test_hostile_dims_are_one_line(dims, content, message, tmp_path, capsys):
    path = tmp_path / "x.ckpt"
    path.write_bytes(raw_value("backbone.layernorm.gamma", dims, "Float32", content))
    with pytest.raises(MindSporeCheckpointError, match=message):
        read_checkpoint(path)
    argv = ["convert", "--from", "mindspore", str(path), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


# --- the way back ---------------------------------------------------------------------


def test_export_order_is_the_mindspore_models(tmp_path):
    model = model_from([FIXTURES / "plain.ckpt"])
    names = list(to_mindspore(model.state_dict(), model.config))
    # PanguAlpha_Model defines embedding, layernorm, blocks, top query
    # embedding, top query layer: MindSpore saves its parameters in that order
    assert names[:4] == [
        *OURS[:2],
        "backbone.layernorm.gamma",
        "backbone.layernorm.beta",
    ]
    assert names[4].startswith("backbone.blocks.0.")
    first_top = names.index(OURS[2])
    assert all(n.startswith("backbone.blocks.") for n in names[4:first_top])
    assert all(
        n.startswith("backbone.top_query_layer.") for n in names[first_top + 1 :]
    )


def test_export_dtype_defaults_to_the_sources(tmp_path, capsys):
    plain = read_checkpoint(FIXTURES / "plain.ckpt")
    half = {k: v.half() for k, v in plain.items()}  # the official parameters' dtype
    write_checkpoint(tmp_path / "half.ckpt", half)
    base = tmp_path / "base"
    argv = ["convert", "--from", "mindspore", str(tmp_path / "half.ckpt")]
    assert main([*argv, "--out", str(base), "--num-heads", "2"]) == 0
    assert RunDir(base).read_config()["source"]["dtype"] == "fp16"

    to = ["convert", "--to", "mindspore", "--run", str(base)]
    assert main([*to, "--out", str(tmp_path / "a" / "b" / "back.ckpt")]) == 0
    back = read_checkpoint(tmp_path / "a" / "b" / "back.ckpt")  # parents made
    assert main([*to, "--out", str(tmp_path / "half.ckpt" / "x.ckpt")]) == 2
    assert "a file is in the way" in capsys.readouterr().err
    assert {t.dtype for t in back.values()} == {torch.float16}
    assert all(torch.equal(back[k], v) for k, v in half.items())  # fp16 -> fp16 exact

    assert main([*to, "--out", str(tmp_path / "f.ckpt"), "--dtype", "fp32"]) == 0
    assert "fp32" in capsys.readouterr().out
    wide = read_checkpoint(tmp_path / "f.ckpt")
    assert all(wide[k].dtype == torch.float32 for k in half)
    assert main([*to, "--out", str(tmp_path / "b.ckpt"), "--dtype", "bf16"]) == 0
    assert read_checkpoint(tmp_path / "b.ckpt")[OURS[0]].dtype == torch.bfloat16


def test_export_keeps_each_tensors_dtype(tmp_path):
    # as the official PanGu-α saves: fp16 weights, fp32 LayerNorms; and one
    # odd tensor, the top query layer's FFN bias, in bf16
    def official(name: str) -> torch.dtype:
        if name == "backbone.top_query_layer.output.mapping.bias":
            return torch.bfloat16
        return torch.float32 if "layernorm" in name else torch.float16

    mixed = {
        k: v.to(official(k))
        for k, v in read_checkpoint(FIXTURES / "plain.ckpt").items()
    }
    write_checkpoint(tmp_path / "mixed.ckpt", mixed)
    base = tmp_path / "base"
    argv = ["convert", "--from", "mindspore", str(tmp_path / "mixed.ckpt")]
    assert main([*argv, "--out", str(base), "--num-heads", "2"]) == 0
    source = RunDir(base).read_config()["source"]
    assert source["dtype"] == "fp16"
    assert source["dtypes"] == {  # by layer pattern where every layer agrees
        "transformer.ln_f.weight": "fp32",
        "transformer.ln_f.bias": "fp32",
        "transformer.h.*.ln_1.weight": "fp32",
        "transformer.h.*.ln_1.bias": "fp32",
        "transformer.h.*.ln_2.weight": "fp32",
        "transformer.h.*.ln_2.bias": "fp32",
        "transformer.h.2.mlp.c_fc.bias": "bf16",
    }
    out = tmp_path / "back.ckpt"
    assert (
        main(["convert", "--to", "mindspore", "--run", str(base), "--out", str(out)])
        == 0
    )
    back = read_checkpoint(out)
    assert {k: t.dtype for k, t in back.items()} == {
        k: t.dtype for k, t in mixed.items()
    }
    assert all(torch.equal(back[k], t) for k, t in mixed.items())  # exact, too


def test_export_dtype_follows_the_base_else_fp32(tmp_path):
    half = {k: v.half() for k, v in read_checkpoint(FIXTURES / "plain.ckpt").items()}
    write_checkpoint(tmp_path / "half.ckpt", half)
    base = tmp_path / "base"
    argv = ["convert", "--from", "mindspore", str(tmp_path / "half.ckpt")]
    assert main([*argv, "--out", str(base), "--num-heads", "2"]) == 0

    def run_like(name: str, **keys) -> Path:
        """A run folder with the base's weights and a config as aisyn
        finetune / train write it (no source of its own)."""
        run = tmp_path / name
        shutil.copytree(base, run)
        config = RunDir(run).read_config()
        del config["source"]
        (run / "config.json").write_text(json.dumps({**config, **keys}))
        return run

    def exported_dtype(run: Path) -> torch.dtype:
        out = tmp_path / f"{run.name}.ckpt"
        to = ["convert", "--to", "mindspore", "--run", str(run), "--out", str(out)]
        assert main(to) == 0
        return read_checkpoint(out)[OURS[0]].dtype

    tuned = run_like("tuned", kind="finetune", base={"path": str(base)})
    assert exported_dtype(tuned) == torch.float16  # the base's, one hop back
    trained = run_like("trained", kind="train", init_from=str(tuned))
    assert exported_dtype(trained) == torch.float16  # two hops
    assert exported_dtype(run_like("scratch", kind="train")) == torch.float32


def test_a_damaged_dtype_record_is_one_line(tmp_path, capsys):
    base = tmp_path / "base"
    argv = ["convert", "--from", "mindspore", str(FIXTURES / "plain.ckpt")]
    assert main([*argv, "--out", str(base), "--num-heads", "2"]) == 0
    config = RunDir(base).read_config()
    config["source"]["dtypes"] = {"transformer.wte.weight": "fp64"}
    (base / "config.json").write_text(json.dumps(config))
    to = ["convert", "--to", "mindspore", "--run", str(base)]
    assert main([*to, "--out", str(tmp_path / "x.ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "source.dtypes is damaged" in err[0]
    assert not (tmp_path / "x.ckpt").exists()

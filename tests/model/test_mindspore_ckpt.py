"""MindSpore .ckpt files: read, written and converted without MindSpore.

The fixtures were written by MindSpore 2.10.0 itself
(tests/fixtures/mindspore/make_fixtures.py); weights.npz holds their arrays.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from aisyn.cli import main
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
from aisyn.model.pangu import PanguAlpha
from aisyn.train.checkpoint import load_weights
from aisyn.train.loop import load_run_model

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
        gather_weights({"f": {**plain, "backbone.extra": torch.zeros(1)}})
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
    for name in ("mindspore_checkpoint_pb2.py", "mindspore_checkpoint_pb2.pyi"):
        assert (tmp_path / name).read_bytes() == (generated / name).read_bytes(), (
            f"{name} is stale: run scripts/gen_mindspore_proto.sh"
        )

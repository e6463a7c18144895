"""PanGu-α weights in the public PyTorch port's layout load into our model.

The fixtures are written here as the port's ``save_pretrained`` writes them
(``config.json`` with ``model_type: gpt_pangu``, the causal-mask buffers it
stores, a separate tied ``lm_head.weight``), single-file and sharded."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from aisyn.model.families import build_model
from aisyn.model.pangu import PanguConfig
from aisyn.model.port import PortError, is_port_folder, read_port, read_port_config
from aisyn.train.checkpoint import CheckpointError, load_weights

CFG = PanguConfig(
    vocab_size=300, hidden_size=32, num_layers=3, num_heads=4, ffn_size=48, seq_len=16
)


def port_config(cfg: PanguConfig) -> dict:
    """config.json as the port writes it (GPTPanguConfig's keys)."""
    return {
        "model_type": "gpt_pangu",
        "architectures": ["GPTPanguForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.seq_len,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "activation_function": "gelu",
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "scale_attn_weights": True,
        "resid_pdrop": 0.1,
    }


def port_tensors(model) -> dict[str, torch.Tensor]:
    """The model's weights plus the buffers the port keeps in its state dict."""
    P = model.config.seq_len
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(model.config.num_layers):
        tensors[f"transformer.h.{i}.attn.bias"] = (
            torch.ones(P, P).tril().to(torch.uint8)[None, None]
        )
        tensors[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return tensors


def write_port(folder, model, layout: str) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(port_config(model.config)))
    tensors = port_tensors(model)
    if layout == "bin":
        torch.save(tensors, folder / "pytorch_model.bin")
    elif layout == "safetensors":
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            folder / "model.safetensors",
        )
    else:  # sharded, as save_pretrained(max_shard_size=...) writes
        suffix = "bin" if layout == "sharded-bin" else "safetensors"
        names = sorted(tensors)
        weight_map = {}
        for k, part in enumerate((names[::2], names[1::2])):
            file = f"model-0000{k + 1}-of-00002.{suffix}"
            shard = {n: tensors[n].contiguous() for n in part}
            if suffix == "bin":
                torch.save(shard, folder / file)
            else:
                save_file(shard, folder / file)
            weight_map.update(dict.fromkeys(part, file))
        index = "pytorch_model.bin" if suffix == "bin" else "model.safetensors"
        (folder / f"{index}.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )


@pytest.mark.parametrize("layout", ["bin", "safetensors", "sharded-bin", "sharded"])
def test_port_folder_loads_with_the_same_logits(tmp_path, layout):
    source = build_model(CFG, seed=3).eval()
    write_port(tmp_path / "port", source, layout)
    assert is_port_folder(tmp_path / "port")
    cfg, tensors = read_port(tmp_path / "port")
    assert cfg == CFG
    model = build_model(cfg, seed=99).eval()
    load_weights(model, tensors, "port")
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    assert torch.equal(model(tokens), source(tokens))


def test_default_ffn_is_four_times_hidden(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(port_config(CFG) | {"intermediate_size": None})
    )
    assert read_port_config(tmp_path).ffn_size == 4 * CFG.hidden_size


def corrupt(folder, how: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    weights = folder / "model.safetensors"
    tensors = port_tensors(build_model(CFG, seed=3))
    if how == "no-config":
        (folder / "config.json").unlink()
    elif how == "other-model":
        (folder / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    elif how == "no-weights":
        weights.unlink()
    elif how == "not-causal":
        tensors["transformer.h.1.attn.bias"] = torch.ones_like(
            tensors["transformer.h.1.attn.bias"]
        )
        save_file({k: v.contiguous() for k, v in tensors.items()}, weights)
    elif how == "untied":
        tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
        save_file({k: v.contiguous() for k, v in tensors.items()}, weights)


@pytest.mark.parametrize(
    "how, message",
    [
        ("no-config", "no config.json; not a model folder"),
        ("other-model", "model_type 'gpt2', not the PanGu-α port's"),
        ("truncated", "model.safetensors: unreadable weights"),
        ("no-weights", "no weights (expected one of model.safetensors"),
        ("not-causal", "transformer.h.1.attn.bias is not a causal mask"),
        ("untied", "lm_head.weight is not tied"),
    ],
)
def test_bad_port_folder_is_one_clear_line(tmp_path, how, message):
    folder = tmp_path / "port"
    write_port(folder, build_model(CFG, seed=3), "safetensors")
    corrupt(folder, how)
    with pytest.raises(PortError, match=re.escape(message)) as e:
        read_port(folder)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("problem", ["missing", "shape"])
def test_missing_or_misshapen_tensor_names_it(tmp_path, problem):
    folder = tmp_path / "port"
    write_port(folder, build_model(CFG, seed=3), "safetensors")
    cfg, tensors = read_port(folder)
    if problem == "missing":
        del tensors["transformer.h.2.mlp.c_fc.weight"]
        match = "missing \\['transformer.h.2.mlp.c_fc.weight'\\]"
    else:
        tensors["transformer.wqe.weight"] = tensors["transformer.wqe.weight"][:-1]
        match = "transformer.wqe.weight has shape"
    with pytest.raises(CheckpointError, match=match):
        load_weights(build_model(cfg), tensors, "port")


def test_sharded_index_that_disagrees_with_its_shards_is_refused(tmp_path):
    folder = tmp_path / "port"
    write_port(folder, build_model(CFG, seed=3), "sharded")
    index = folder / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    d["weight_map"]["transformer.extra"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(d))
    with pytest.raises(PortError, match="disagree about 'transformer.extra'"):
        read_port(folder)
    d["weight_map"]["transformer.extra"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(d))
    with pytest.raises(PortError, match="is not a file name"):
        read_port(folder)


class Payload:
    """What a hostile pytorch_model.bin could hold: unpickling runs ``touch``."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.target}",))


def test_a_bin_file_that_would_run_code_is_refused_without_running_it(tmp_path):
    folder = tmp_path / "port"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(port_config(CFG)))
    witness = tmp_path / "ran"
    torch.save(
        {"transformer.wte.weight": Payload(witness)}, folder / "pytorch_model.bin"
    )
    with pytest.raises(PortError, match="pytorch_model.bin: unreadable weights"):
        read_port(folder)
    assert not witness.exists()


def test_convert_cli_writes_a_base_run_with_the_ports_tokenizer(tmp_path, capsys):
    from aisyn.cli import main
    from aisyn.data.tokenizer import PanguTokenizer
    from aisyn.train.models import load_run_model

    tok = PanguTokenizer.load()
    cfg = PanguConfig(
        vocab_size=tok.vocab_size,
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        ffn_size=32,
        seq_len=16,
    )
    source = build_model(cfg, seed=5).eval()
    write_port(tmp_path / "port", source, "bin")
    (tmp_path / "port" / "vocab.model").write_bytes(tok.path.read_bytes())
    out = tmp_path / "base"
    assert (
        main(
            [
                "convert",
                "--from",
                "pangu-port",
                str(tmp_path / "port"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "2 layers, hidden 16" in capsys.readouterr().out
    model, config = load_run_model(out)
    assert config["tokenizer"]["sha256"] == tok.sha256
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    assert torch.equal(model(tokens), source(tokens))


def test_convert_cli_refuses_a_tokenizer_that_does_not_fit_the_weights(
    tmp_path, capsys
):
    from aisyn.cli import main
    from aisyn.data.tokenizer import PanguTokenizer

    write_port(tmp_path / "port", build_model(CFG, seed=3), "safetensors")
    tok = PanguTokenizer.load()
    out = tmp_path / "base"
    rc = main(
        [
            "convert",
            "--from",
            "pangu-port",
            str(tmp_path / "port"),
            "--out",
            str(out),
            "--tokenizer",
            str(tok.path),
        ]
    )
    assert rc == 2
    assert "8000 pieces, but the weights' word embedding has 300 rows" in (
        capsys.readouterr().err
    )
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "port"]

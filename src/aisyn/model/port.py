"""PanGu-α weights from the public PyTorch port (Hugging Face ``gpt_pangu``).

The port (e.g. the ``pangu-350M`` / ``pangu-2_6B`` folders, converted from the
MindSpore checkpoints; modeling file ``modeling_gptpangu.py``) names its
modules as ``PanguAlpha`` does: ``transformer.{wte,wpe,wqe,h.N,ln_f}`` and
``lm_head``, with ``h.N.attn.{q,k,v,c}_proj`` and ``h.N.mlp.{c_fc,c_proj}``;
the last block is the top query layer, fed ``ln_f`` of the hidden states and
the query embedding ``wqe``. It differs in what else it stores:

* each attention's causal mask (``attn.bias``, a (1, 1, P, P) lower triangle)
  and fill value (``attn.masked_bias``): buffers we compute instead; they are
  checked (a mask that is not causal would mean another model) and dropped;
* ``lm_head.weight``, tied to ``wte`` (checked equal where both are present).

A folder holds ``config.json`` and the weights as ``model.safetensors``,
``pytorch_model.bin`` (read with ``weights_only=True``: tensors only, nothing
executed), or either sharded with an ``*.index.json``.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from aisyn.model.capacity import check_against_weights
from aisyn.model.pangu import PanguConfig
from aisyn.validate import json_field, read_json

MODEL_TYPE = "gpt_pangu"
#: the port's activation_function (transformers' ACT2FN names) -> ours;
#: transformers' quick_gelu is x * sigmoid(1.702 x), MindSpore's fast_gelu
PORT_ACTIVATIONS = {"gelu": "gelu", "quick_gelu": "fast_gelu"}
_PORT_NAMES = {v: k for k, v in PORT_ACTIVATIONS.items()}
# In the order the port's ``save_pretrained`` prefers them.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class PortError(ValueError):
    """A folder that is not (or not a readable copy of) the PanGu-α port."""


def is_port_folder(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        c = read_json(config)
    except ValueError:
        return False
    return c.get("model_type") == MODEL_TYPE


def folder_config(
    folder: str | Path, error: type[ValueError], kind: str = "a model folder"
) -> tuple[Path, dict]:
    """(path, parsed JSON object) of a model folder's ``config.json``; ``error``
    with one line if it is missing, not JSON, too large or too deep."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise error(f"{folder}: no config.json; not {kind}")
    return path, read_json(path, error=error)


def read_port_config(folder: str | Path) -> PanguConfig:
    """Our ``PanguConfig`` of the port's ``config.json``."""
    path, c = folder_config(folder, PortError)
    if c.get("model_type") != MODEL_TYPE:
        raise PortError(
            f"{path}: model_type {c.get('model_type')!r:.40}, not the PanGu-α "
            f"port's {MODEL_TYPE!r}"
        )

    def get(key: str, kind, default):
        return json_field(c, key, kind, default, str(path), error=PortError)

    act = get("activation_function", str, "gelu")
    if act not in PORT_ACTIVATIONS:
        raise PortError(
            f"{path}: activation {act!r:.40}, not one of {', '.join(PORT_ACTIVATIONS)}"
        )
    if not get("scale_attn_weights", bool, True):
        raise PortError(f"{path}: unscaled attention is not PanGu-α's")
    hidden = get("hidden_size", int, 2560)
    fields = {
        "vocab_size": get("vocab_size", int, 40000),
        "hidden_size": hidden,
        "num_layers": get("num_layers", int, 32),
        "num_heads": get("num_heads", int, 32),
        "ffn_size": get("intermediate_size", int, 4 * hidden),
        "seq_len": get("max_position_embeddings", int, 1024),
        "layer_norm_eps": get("layer_norm_epsilon", (int, float), 1e-5),
        "activation": PORT_ACTIVATIONS[act],
    }
    try:
        return PanguConfig.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise PortError(f"{path}: {e}") from None


def _read_file(path: Path, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of one weight file; ``mmap`` maps a ``.bin`` instead of
    reading it (its shapes are then known without its data)."""
    if not path.is_file():
        raise PortError(f"{path}: weight file missing")
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (
        SafetensorError,
        pickle.UnpicklingError,
        OSError,
        RuntimeError,
        ValueError,
        EOFError,
    ) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PortError(f"{path}: unreadable weights ({first})") from None
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
    ):
        raise PortError(f"{path}: not a state dict of named tensors")
    return tensors


def _weights_file(folder: Path, required: bool = True) -> str | None:
    """The first of ``WEIGHT_FILES`` in ``folder``; PortError if there is none,
    unless not ``required`` (then None)."""
    name = next((f for f in WEIGHT_FILES if (folder / f).is_file()), None)
    if name is None and required:
        raise PortError(
            f"{folder}: no weights (expected one of {', '.join(WEIGHT_FILES)})"
        )
    return name


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Which file of a model folder holds each stored tensor name (read from
    the shard index, or from the one file's header)."""
    from safetensors import safe_open

    folder = Path(folder)
    name = _weights_file(folder)
    if name.endswith(".index.json"):
        weight_map = _shard_index(folder / name)
        return {k: folder / v for k, v in weight_map.items()}
    if name.endswith(".bin"):
        return {k: folder / name for k in _read_file(folder / name)}
    try:
        with safe_open(str(folder / name), framework="pt") as f:
            return {k: folder / name for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise PortError(f"{folder / name}: unreadable weights ({e})") from None


def stored_shapes(folder: str | Path) -> dict[str, tuple[int, ...]] | None:
    """Every stored tensor's shape (name as stored), from the weight files'
    headers (a ``.bin`` is memory-mapped, not read); None if the folder holds
    no weights. What a config is checked against before anything is built."""
    from safetensors import safe_open

    folder = Path(folder)
    name = _weights_file(folder, required=False)
    if name is None:
        return None
    files = [name]
    if name.endswith(".index.json"):
        files = sorted(set(_shard_index(folder / name).values()))
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        path = folder / file
        if not path.name.endswith(".safetensors"):
            try:
                tensors = _read_file(path, mmap=True)
            except PortError:  # a legacy (non-zip) .bin cannot be mapped
                tensors = _read_file(path)
            shapes.update((k, tuple(v.shape)) for k, v in tensors.items())
            continue
        if not path.is_file():
            raise PortError(f"{path}: weight file missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except (SafetensorError, OSError) as e:
            raise PortError(f"{path}: unreadable weights ({e})") from None
    return shapes


def _shard_index(path: Path) -> dict[str, str]:
    index = read_json(path, error=PortError)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise PortError(f"{path}: bad shard index (no weight_map object)")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard:
            # the index names files beside it, no paths
            raise PortError(
                f"{path}: shard {shard!r:.60} of {name!r:.60} is not a file name"
            )
    return weight_map


def read_folder_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder's weight files (all shards), as stored."""
    folder = Path(folder)
    name = _weights_file(folder)
    if not name.endswith(".index.json"):
        return _read_file(folder / name)
    weight_map = _shard_index(folder / name)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(_read_file(folder / shard))
    listed, found = set(weight_map), set(tensors)
    if listed != found:
        odd = sorted(listed ^ found)[0]
        raise PortError(
            f"{folder / name}: the index and the shards disagree about {odd!r}"
        )
    return tensors


def check_weight_values(tensors: dict[str, torch.Tensor], source: str) -> None:
    """``PortError`` naming the first tensor that is not floating point (an
    int64 "weight" would be cast silently on load) or holds NaN or inf (a
    model that runs, prints garbage and exits 0). One pass per tensor."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise PortError(
                f"{source}: {name} is {str(t.dtype).removeprefix('torch.')}, "
                "not floating-point weights"
            )
        if not bool(torch.isfinite(t).all()):
            raise PortError(
                f"{source}: {name} holds non-finite values (NaN or inf); "
                "the weights are corrupt"
            )


def port_state_dict(
    tensors: dict[str, torch.Tensor], cfg: PanguConfig, source: str
) -> dict[str, torch.Tensor]:
    """The port's tensors minus its buffers, checked, named as ``PanguAlpha``'s."""
    out = {}
    causal = None  # built once a mask has the config's size, never before
    size = (cfg.seq_len, cfg.seq_len)
    for name, t in tensors.items():
        if name.endswith(".attn.masked_bias"):
            continue  # the port's fill value for masked scores; we use -inf
        if name.endswith(".attn.bias") and t.dim() == 4:
            if tuple(t.shape[-2:]) != size:
                raise PortError(f"{source}: {name} is not a causal mask of this size")
            if causal is None:
                causal = torch.ones(size, dtype=torch.bool).tril()
            if not torch.equal(t[0, 0].bool(), causal):
                raise PortError(f"{source}: {name} is not a causal mask of this size")
            continue
        out[name] = t
    head, wte = out.get("lm_head.weight"), out.get("transformer.wte.weight")
    if head is not None and wte is not None and not torch.equal(head, wte):
        raise PortError(
            f"{source}: lm_head.weight is not tied to transformer.wte.weight"
        )
    return out


def read_port(folder: str | Path) -> tuple[PanguConfig, dict[str, torch.Tensor]]:
    """(config, state dict for ``PanguAlpha``) of a port folder; load the state
    dict with ``train.checkpoint.load_weights``, which checks every name and
    shape."""
    cfg = read_port_config(folder)
    _weights_file(Path(folder))  # PortError if there are none
    shapes = stored_shapes(folder)
    try:
        check_against_weights(cfg, shapes, str(folder), "num_layers")
    except PortError:
        raise
    except ValueError as e:
        raise PortError(str(e)) from None
    state = port_state_dict(read_folder_tensors(folder), cfg, str(folder))
    check_weight_values(state, str(folder))
    return cfg, state


def port_config(cfg: PanguConfig) -> dict:
    """The port's ``config.json`` for ``cfg`` (what ``read_port_config`` reads)."""
    return {
        "architectures": ["GPTPanguForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "intermediate_size": cfg.ffn_size,
        "max_position_embeddings": cfg.seq_len,
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "activation_function": _PORT_NAMES[cfg.activation],
        "scale_attn_weights": True,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": True,
    }


def write_port_folder(
    cfg: PanguConfig, state: dict[str, torch.Tensor], out: Path
) -> list[Path]:
    """``config.json`` + ``model.safetensors`` in the port's layout (our names
    are its names; the tied head is stored once, as ``transformer.wte``)."""
    from safetensors.torch import save_file

    config = out / "config.json"
    config.write_text(json.dumps(port_config(cfg), indent=2) + "\n")
    weights = out / "model.safetensors"
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    tensors.pop("lm_head.weight", None)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return [config, weights]

"""The Hugging Face side of GPT-2, Llama and Qwen2: their config (``HFConfig``),
its presets, the ``config.json`` that transformers reads and writes, and the
folders ``save_pretrained`` writes (``read_hf_folder``, ``read_hf_tensors``,
``write_hf_folder``). The architectures are ``gpt2.py`` and ``llama.py``.

Parameter names are ``transformers``' own, so a folder loads by name and a run
writes one back. One difference: GPT-2 keeps its projections as ``Conv1D``
(weight stored [in, out]); ours are ``nn.Linear`` ([out, in], what peft's LoRA
and our optimizer expect), transposed here, at the folder boundary.

Dropout is off (0.0) for models read from a folder, whatever their config
says: fine-tuning here is deterministic, and split runs stay exact.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from aisyn.model.capacity import check_against_weights
from aisyn.model.causal_lm import ConfigDict, Layout
from aisyn.validate import json_field

FAMILIES = ("gpt2", "llama", "qwen2")
ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}
HF_PREFIX = "hf:"


class HFError(ValueError):
    """A folder that is not a Hugging Face model we can run."""


@dataclass
class HFConfig(ConfigDict):
    """The dimensions of a GPT-2, Llama or Qwen2 model.

    ``num_layers`` counts the blocks (there is no extra head layer);
    ``num_kv_heads`` < ``num_heads`` is grouped-query attention.
    """

    family: str = "llama"
    vocab_size: int = 8000
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 0  # 0: as many as num_heads
    head_dim: int = 0  # 0: hidden_size // num_heads
    ffn_size: int = 344
    seq_len: int = 256
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    attention_bias: bool = False  # Llama: q/k/v/o; Qwen2 always has q/k/v
    mlp_bias: bool = False
    activation: str = "silu"
    dropout: float = 0.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(
                f"model family {self.family!r} is not supported; supported: "
                f"pangu, {', '.join(FAMILIES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "ffn_size",
            "seq_len",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("num_kv_heads", "head_dim"):  # 0: derived below
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.num_kv_heads == 0:
            self.num_kv_heads = self.num_heads
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by "
                    f"num_heads {self.num_heads}; pick heads that divide it"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}"
            )
        if self.family == "gpt2":
            if self.head_dim * self.num_heads != self.hidden_size:
                raise ValueError("GPT-2 needs head_dim * num_heads == hidden_size")
            if self.num_kv_heads != self.num_heads:
                raise ValueError("GPT-2 has no grouped-query attention")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation {self.activation!r} is not supported "
                f"({', '.join(ACTIVATIONS)})"
            )
        for name in ("norm_eps", "rope_theta", "init_std"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def num_blocks(self) -> int:
        return self.num_layers

    @property
    def layout(self) -> Layout:
        if self.family == "gpt2":
            return Layout(
                family="gpt2",
                num_blocks=self.num_layers,
                embed=("transformer.wte", "transformer.wpe"),
                block="transformer.h.{i}",
                head=("transformer.wte", "transformer.ln_f"),
                head_label="ln_f + head",
            )
        head = ("model.norm", "lm_head")
        if self.tie_embeddings:
            head = ("model.embed_tokens", "model.norm")
        return Layout(
            family=self.family,
            num_blocks=self.num_layers,
            embed=("model.embed_tokens",),
            block="model.layers.{i}",
            head=head,
            head_label="norm + lm_head",
        )

    @property
    def block_matmul_weights(self) -> int:
        """Weights of one block's matrix products (planner's FLOP count)."""
        h, f = self.hidden_size, self.ffn_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        mlp = 2 * h * f if self.family == "gpt2" else 3 * h * f
        return 2 * h * q + 2 * h * kv + mlp

    def parameter_count(self) -> int:
        """Parameters of the model (a tied head once), by arithmetic: what
        ``capacity`` weighs before anything is built, for any size."""
        h, f, V = self.hidden_size, self.ffn_size, self.vocab_size
        if self.family == "gpt2":
            # c_attn, c_proj, ln_1 + ln_2, c_fc and c_proj with biases
            layer = 4 * (h * h + h) + 4 * h + 2 * h * f + f + h
            return V * h + self.seq_len * h + 2 * h + self.num_layers * layer
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_bias = self.attention_bias or self.family == "qwen2"
        attn = 2 * h * q + 2 * h * kv + (q + 2 * kv) * qkv_bias
        attn += h * self.attention_bias  # o_proj's bias
        mlp = 3 * h * f + (2 * f + h) * self.mlp_bias
        layer = attn + mlp + 2 * h  # and two RMSNorm gains
        head = 0 if self.tie_embeddings else V * h
        return V * h + head + h + self.num_layers * layer

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The Linear modules LoRA adapts in this family."""
        if self.family == "gpt2":
            return ("c_attn", "c_proj", "c_fc")
        return (
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        )


# Small random-init presets of each family, for tests and trying things out.
_TINY = dict(hidden_size=128, num_layers=4, num_heads=4, seq_len=128, vocab_size=8000)
_TINY_GQA = dict(_TINY, num_kv_heads=2, ffn_size=344)
HF_CONFIGS: dict[str, dict] = {
    "gpt2-tiny": dict(
        _TINY,
        family="gpt2",
        ffn_size=512,
        norm_eps=1e-5,
        activation="gelu_new",
        tie_embeddings=True,
    ),
    "llama-tiny": dict(_TINY_GQA, family="llama"),
    "qwen2-tiny": dict(_TINY_GQA, family="qwen2", tie_embeddings=True),
}


# GPT-2 projections stored by transformers as Conv1D ([in, out]).
_CONV1D = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)


def _rope_theta(c: dict, path: Path) -> float:
    where = str(path)
    params = json_field(c, "rope_parameters", dict, {}, where, error=HFError)
    scaling = json_field(c, "rope_scaling", dict, {}, where, error=HFError)
    for section in (params, scaling):
        kind = section.get("rope_type") or section.get("type") or "default"
        if kind != "default":
            raise HFError(
                f"{path}: rope type {kind!r:.40} is not supported (only default)"
            )
    theta = json_field(c, "rope_theta", (int, float), 10000.0, where, error=HFError)
    return json_field(params, "rope_theta", (int, float), theta, where, error=HFError)


def config_from_hf(c: dict, path: Path) -> HFConfig:
    """Our ``HFConfig`` of a ``config.json`` as transformers writes it; every
    field read is type-checked first (a list where a number belongs fails
    with the field's name, not an AttributeError)."""
    family = c.get("model_type")
    if family not in FAMILIES:
        raise HFError(
            f"{path}: model_type {family!r:.40} is not supported; supported: "
            f"{', '.join(FAMILIES)} (and PanGu-α: gpt_pangu, through "
            "aisyn convert --from pangu-port)"
        )

    def get(key: str, kind, default):
        return json_field(c, key, kind, default, str(path), error=HFError)

    number = (int, float)
    try:
        if family == "gpt2":
            for flag in (
                "scale_attn_by_inverse_layer_idx",
                "reorder_and_upcast_attn",
                "add_cross_attention",
            ):
                if get(flag, bool, False):
                    raise HFError(f"{path}: GPT-2 with {flag} is not supported")
            if not get("scale_attn_weights", bool, True):
                raise HFError(
                    f"{path}: GPT-2 without scale_attn_weights is not supported"
                )
            h = get("n_embd", int, 768)
            return HFConfig(
                family="gpt2",
                vocab_size=get("vocab_size", int, 50257),
                hidden_size=h,
                num_layers=get("n_layer", int, 12),
                num_heads=get("n_head", int, 12),
                ffn_size=get("n_inner", int, 4 * h),
                seq_len=get("n_positions", int, 1024),
                norm_eps=get("layer_norm_epsilon", number, 1e-5),
                activation=get("activation_function", str, "gelu_new"),
                tie_embeddings=True,
                init_std=get("initializer_range", number, 0.02),
            )
        if get("use_sliding_window", bool, False):
            raise HFError(f"{path}: sliding-window attention is not supported")
        if get("pretraining_tp", int, 1) != 1:
            raise HFError(f"{path}: pretraining_tp != 1 is not supported")
        heads = get("num_attention_heads", int, 32)
        return HFConfig(
            family=family,
            vocab_size=get("vocab_size", int, 32000),
            hidden_size=get("hidden_size", int, 4096),
            num_layers=get("num_hidden_layers", int, 32),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", int, heads),
            head_dim=get("head_dim", int, 0),
            ffn_size=get("intermediate_size", int, 11008),
            seq_len=get("max_position_embeddings", int, 2048),
            norm_eps=get("rms_norm_eps", number, 1e-6),
            rope_theta=_rope_theta(c, path),
            tie_embeddings=get("tie_word_embeddings", bool, False),
            attention_bias=get("attention_bias", bool, False) and family == "llama",
            mlp_bias=get("mlp_bias", bool, False),
            activation=get("hidden_act", str, "silu"),
            init_std=get("initializer_range", number, 0.02),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, HFError):
            raise
        raise HFError(f"{path}: {e}") from None


def config_to_hf(cfg: HFConfig) -> dict:
    """The ``config.json`` transformers reads for ``cfg`` (no ``auto_map``)."""
    if cfg.family == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads,
            "n_inner": cfg.ffn_size,
            "activation_function": cfg.activation,
            "layer_norm_epsilon": cfg.norm_eps,
            "initializer_range": cfg.init_std,
            "tie_word_embeddings": True,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        }
    arch = "LlamaForCausalLM" if cfg.family == "llama" else "Qwen2ForCausalLM"
    out = {
        "architectures": [arch],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": cfg.activation,
        "initializer_range": cfg.init_std,
        "attention_dropout": 0.0,
    }
    if cfg.family == "llama":
        out.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
    return out


def read_hf_config(folder: str | Path) -> HFConfig:
    """The config of a ``save_pretrained`` folder, checked against the shapes
    its weights hold (from their headers) when it has weights."""
    from aisyn.model.port import PortError, folder_config, stored_shapes

    path, c = folder_config(folder, HFError, "a Hugging Face model folder")
    cfg = config_from_hf(c, path)
    try:
        shapes = stored_shapes(folder)
        if shapes is not None:
            ours = _our_shapes(shapes, cfg)
            layers = "n_layer" if cfg.family == "gpt2" else "num_hidden_layers"
            check_against_weights(cfg, ours, str(folder), layers)
    except PortError as e:
        raise HFError(str(e)) from None
    except ValueError as e:
        if isinstance(e, HFError):
            raise
        raise HFError(str(e)) from None
    return cfg


def _our_shapes(
    shapes: dict[str, tuple[int, ...]], cfg: HFConfig
) -> dict[str, tuple[int, ...]]:
    """Stored shapes under our names and in our layout (``hf_state_dict``'s
    renaming, for shapes alone)."""
    if cfg.family != "gpt2":
        return shapes
    out = {}
    for name, shape in shapes.items():
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        out[name] = shape[::-1] if name.endswith(_CONV1D) else shape
    return out


def hf_state_dict(
    tensors: dict[str, torch.Tensor], cfg: HFConfig, source: str
) -> dict[str, torch.Tensor]:
    """A folder's tensors named and shaped as our model's: GPT-2's Conv1D
    weights transposed, its causal-mask buffers dropped, the un-prefixed
    names of a bare ``GPT2Model`` given their ``transformer.`` prefix, and a
    tied head stored once."""
    out = {}
    for name, t in tensors.items():
        if cfg.family == "gpt2":
            if name.endswith((".attn.bias", ".attn.masked_bias")) and t.dim() != 1:
                continue  # transformers' causal mask buffers: we compute masks
            if name.endswith(".attn.masked_bias"):
                continue
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name
            if name.endswith(_CONV1D):
                t = t.t().contiguous()
        out[name] = t
    embed = (
        "transformer.wte.weight"
        if cfg.family == "gpt2"
        else "model.embed_tokens.weight"
    )
    if cfg.family == "gpt2" or cfg.tie_embeddings:
        head = out.pop("lm_head.weight", None)
        if head is not None and embed in out and not torch.equal(head, out[embed]):
            raise HFError(f"{source}: lm_head.weight is not tied to {embed}")
    return out


def read_hf_folder(folder: str | Path) -> tuple[HFConfig, dict[str, torch.Tensor]]:
    """(config, state dict for our model) of a ``save_pretrained`` folder; load
    the state dict with ``train.checkpoint.load_weights``, which checks every
    name and shape."""
    from aisyn.model.port import PortError, check_weight_values, read_folder_tensors

    cfg = read_hf_config(folder)
    try:
        state = hf_state_dict(read_folder_tensors(folder), cfg, str(folder))
        check_weight_values(state, str(folder))
    except PortError as e:
        raise HFError(str(e)) from None
    return cfg, state


def stored_name(name: str, cfg: HFConfig, stored: set[str]) -> str:
    """The name ``name`` (ours) has in a folder holding ``stored``."""
    if cfg.family == "gpt2" and name not in stored:
        bare = name.removeprefix("transformer.")
        if bare in stored:
            return bare
    return name


def read_hf_tensors(
    folder: str | Path,
    shapes: dict[str, tuple[int, ...]],
    whose: str,
    *,
    read: bool = True,
) -> dict[str, torch.Tensor]:
    """Only the tensors named in ``shapes`` (ours: name -> shape) from a
    ``save_pretrained`` folder, checked; ``read=False`` only checks.

    Safetensors files (one, or shards listed in an index) are read lazily by
    their headers, so a party that owns a few tensors of a large model reads
    just those; a ``pytorch_model.bin`` is read whole (``weights_only``).
    """
    from safetensors import SafetensorError, safe_open

    from aisyn.model.port import PortError, check_weight_values, weight_files

    folder = Path(folder)
    cfg = read_hf_config(folder)
    try:
        files = weight_files(folder)  # stored name -> file
    except PortError as e:
        raise HFError(str(e)) from None
    out: dict[str, torch.Tensor] = {}
    if any(f.suffix != ".safetensors" for f in files.values()):
        state = {k: v for k, v in read_hf_folder(folder)[1].items() if k in shapes}
        missing = sorted(set(shapes) - set(state))
        if missing:
            raise HFError(f"{folder}: lacks {missing[0]} ({whose})")
        for name, t in state.items():
            if tuple(t.shape) != tuple(shapes[name]):
                raise HFError(
                    f"{folder}: {name} has shape {tuple(t.shape)}, expected "
                    f"{tuple(shapes[name])}"
                )
        return state if read else {}
    stored = set(files)
    try:
        for name, shape in shapes.items():
            key = stored_name(name, cfg, stored)
            if key not in files:
                raise HFError(f"{folder}: lacks {name} ({whose})")
            with safe_open(str(files[key]), framework="pt") as f:
                got = tuple(f.get_slice(key).get_shape())
                conv = cfg.family == "gpt2" and name.endswith(_CONV1D)
                if conv:
                    got = got[::-1]
                if got != tuple(shape):
                    raise HFError(
                        f"{folder}: {name} has shape {got}, expected {tuple(shape)}"
                    )
                if read:
                    t = f.get_tensor(key)
                    out[name] = t.t().contiguous() if conv else t
        check_weight_values(out, str(folder))
    except (SafetensorError, OSError) as e:
        raise HFError(f"{folder}: unreadable weights ({e})") from None
    except PortError as e:
        raise HFError(str(e)) from None
    return out


def write_hf_folder(
    cfg: HFConfig, state: dict[str, torch.Tensor], out: Path
) -> list[Path]:
    """``config.json`` + ``model.safetensors`` that transformers loads as
    ``cfg``'s family; returns the files written (into ``out``, which the
    caller creates and later moves into place)."""
    tied = cfg.family == "gpt2" or cfg.tie_embeddings
    tensors = {}
    for name, t in state.items():
        if tied and name == "lm_head.weight":
            continue  # transformers ties it to the embedding on load
        t = t.detach().cpu()
        if cfg.family == "gpt2" and name.endswith(_CONV1D):
            t = t.t()
        tensors[name] = t.contiguous()
    if cfg.family != "gpt2" and not cfg.tie_embeddings:
        if "lm_head.weight" not in tensors:
            raise HFError("an untied model's state lacks lm_head.weight")
    config = out / "config.json"
    config.write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
    weights = out / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return [config, weights]

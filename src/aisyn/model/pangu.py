"""PanGu-α in one file.

A decoder-only transformer (Zeng et al., 2021, arXiv:2104.12369) with three
twists over GPT-2:

* pre-LN blocks, then a final LayerNorm *before* the last layer;
* the last layer is the *top query layer*: its attention queries come from a
  learned per-position query embedding (``wqe``) instead of the hidden states,
  while keys and values come from the (normalised) hidden states;
* the output projection is tied to the word embedding.

The MLP's activation is the exact GELU by default; MindSpore's PanGu-α uses
``fast_gelu`` (x * sigmoid(1.702 x)), which a model converted from MindSpore
records as ``activation`` so that it computes what the original did.

Parameter names follow the public PyTorch port of PanGu-α
(``GPTPanguForCausalLM``: ``transformer.wte/wpe/wqe``, ``transformer.h.{i}``
with ``ln_1``, ``attn.{q,k,v,c}_proj``, ``ln_2``, ``mlp.{c_fc,c_proj}``,
``transformer.ln_f``, ``lm_head``) so its checkpoints load as they are. As in
that port, ``num_layers`` counts the top query layer: ``h[-1]`` is it.

The model knows nothing about parties, LoRA or Flower. It is a ``CausalLM``
(``causal_lm.py``) on the body it shares with GPT-2 (``gpt.py``): its
``Layout`` names the cut points that ``segments.py`` cuts it at, and the
generic ``hidden``/``forward`` (with an optional ``KVCache`` for generation)
run its pieces in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from aisyn.model.causal_lm import ConfigDict, Context, LayerKV, Layout, attend
from aisyn.model.gpt import GPTLM, GPTBody


@dataclass
class PanguConfig(ConfigDict):
    """Model dimensions. ``num_layers`` includes the top query layer."""

    vocab_size: int = 40000
    hidden_size: int = 2560
    num_layers: int = 32
    num_heads: int = 32
    ffn_size: int = 10240
    seq_len: int = 1024  # max positions of wpe / wqe
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02
    activation: str = "gelu"  # of the MLP; one of ACTIVATIONS

    def __post_init__(self) -> None:
        if not isinstance(self.activation, str) or self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {', '.join(ACTIVATIONS)}, got "
                f"{self.activation!r}"
            )
        # Sizes first: a zero count would fail the divisibility check below
        # with a ZeroDivisionError that names nothing.
        if self.num_layers < 1:
            raise ValueError(
                f"num_layers must be >= 1 (the top query layer), got {self.num_layers}"
            )
        for name in ("vocab_size", "hidden_size", "num_heads", "ffn_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_heads {self.num_heads}; pick heads that divide it"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        # A LayerNorm with eps <= 0 divides by zero on a constant row (NaN
        # logits, nothing said); a non-positive init std draws nothing sane.
        for name in ("layer_norm_eps", "init_std"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")

    def to_dict(self) -> dict:
        # The default activation is left out, so that the config (and every
        # comparison or record of it: resume, the split handshake, a run's
        # config.json) of a GELU model is what it was before the field existed.
        d = super().to_dict()
        if d["activation"] == "gelu":
            del d["activation"]
        return d

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def num_blocks(self) -> int:
        """Ordinary blocks: every layer but the top query layer."""
        return self.num_layers - 1

    @property
    def family(self) -> str:
        return "pangu"

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The Linear modules LoRA adapts: attention and MLP of every block."""
        return ("q_proj", "k_proj", "v_proj", "c_proj", "c_fc")

    @property
    def block_matmul_weights(self) -> int:
        """Weights of one block's matrix products (planner's FLOP count)."""
        h, f = self.hidden_size, self.ffn_size
        return 4 * h * h + 2 * h * f

    def parameter_count(self) -> int:
        """Parameters of the model (the tied head once), by arithmetic: what
        ``capacity`` weighs before anything is built, for any size."""
        h, f = self.hidden_size, self.ffn_size
        # q/k/v/c with biases, ln_1 + ln_2, c_fc and c_proj with biases
        layer = 4 * (h * h + h) + 4 * h + 2 * h * f + f + h
        # wte (= head), wpe, wqe, ln_f
        return (
            self.vocab_size * h
            + 2 * self.seq_len * h
            + 2 * h
            + (self.num_layers * layer)
        )

    @property
    def layout(self) -> Layout:
        top = self.num_layers - 1
        return Layout(
            family="pangu",
            num_blocks=top,
            embed=("transformer.wte", "transformer.wpe"),
            block="transformer.h.{i}",
            # The head is tied to wte: a head holder also holds wte.
            head=(
                "transformer.wte",
                "transformer.ln_f",
                "transformer.wqe",
                f"transformer.h.{top}",
            ),
            head_layers=1,
            head_label=f"ln_f + top query h[{top}] + head",
        )

    @classmethod
    def check_dict(cls, d: dict) -> None:
        # Types first: a string where a number belongs would otherwise fail in
        # __post_init__'s arithmetic with a message that names nothing.
        for f in fields(cls):
            if f.name not in d:
                continue
            value, want = d[f.name], type(f.default)
            if want is str:
                if not isinstance(value, str):
                    raise ValueError(f"{f.name} must be a string, got {value!r}")
                continue
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if not (numeric and (want is float or isinstance(value, int))):
                kind = "an integer" if want is int else "a number"
                raise ValueError(f"{f.name} must be {kind}, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value!r}")


def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """MindSpore's ``fast_gelu``: x * sigmoid(1.702 x) (= x / (1 + exp(-1.702 x)))."""
    return x * torch.sigmoid(1.702 * x)


#: the MLP activations a ``PanguConfig`` may name
ACTIVATIONS = {"gelu": F.gelu, "fast_gelu": fast_gelu}


def _sizes(hidden: int, layers: int, heads: int, ffn: int, **more) -> dict:
    """A preset's fields, in ``PanguConfig``'s order: the four sizes the
    reference's table lists, and ``more``."""
    given = dict(
        more, hidden_size=hidden, num_layers=layers, num_heads=heads, ffn_size=ffn
    )
    return {f.name: given[f.name] for f in fields(PanguConfig) if f.name in given}


# The reference's table (seed 000) plus CPU-sized presets for tests and demos,
# which have a small vocabulary and context too.
CONFIGS: dict[str, dict] = {
    "tiny": _sizes(128, 4, 4, 512, vocab_size=8000, seq_len=128),
    "small": _sizes(256, 6, 8, 1024, vocab_size=8000, seq_len=256),
    "350M": _sizes(1280, 16, 32, 5120),
    "2.6B": _sizes(2560, 32, 32, 10240),
    "13B": _sizes(5120, 40, 40, 20480),
    "200B": _sizes(16384, 64, 128, 65536),
}


class Attention(nn.Module):
    """Multi-head causal attention; queries optionally from a separate input.

    With ``kv`` (a ``LayerKV``), ``x`` holds only the new positions: their keys
    and values are appended to the cache and the queries attend to all cached
    positions. Without it, the plain training path runs unchanged.
    """

    def __init__(self, cfg: PanguConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.dropout = cfg.dropout
        # Separate q/k/v (not a fused qkv) to keep the public port's names.
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.c_proj = nn.Linear(h, h)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        query: torch.Tensor | None = None,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        nh = self.num_heads
        q_in = x if query is None else query
        q = self.q_proj(q_in).view(B, T, nh, C // nh).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, nh, C // nh).transpose(1, 2)
        v = self.v_proj(x).view(B, T, nh, C // nh).transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        y = attend(q, k, v, attn_mask, kv, dropout)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class PanguAlpha(GPTLM):
    """PanGu-α language model (``GPTPanguForCausalLM`` layout): GPT-2's body
    plus the query embedding ``wqe``; ``transformer.h[-1]`` is the top query
    layer (the block whose attention is given ``query``)."""

    def __init__(self, cfg: PanguConfig, seed: int = 0) -> None:
        eps = cfg.layer_norm_eps
        act = ACTIVATIONS[cfg.activation]
        super().__init__(cfg, seed, GPTBody(cfg, Attention, act, eps, wqe=True))

    def finish(
        self, x: torch.Tensor, ctx: Context, kvs: list[LayerKV] | None = None
    ) -> torch.Tensor:
        """Final LN then the top query layer. (B, T, C) -> (B, T, C).

        With ``kvs`` the top layer's keys and values (from the normalised hidden
        states) are cached like any block's; its queries are the query
        embeddings of ``ctx.position_ids``, the new positions.
        """
        position_ids = ctx.position_ids
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        query = self.transformer.wqe(position_ids).expand(x.shape[0], -1, -1)
        x = self.transformer.ln_f(x)
        return self.transformer.h[-1](x, ctx.attn_mask, query, kvs[0] if kvs else None)

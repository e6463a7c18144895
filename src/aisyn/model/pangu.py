"""PanGu-α in one file.

A decoder-only transformer (Zeng et al., 2021, arXiv:2104.12369) with three
twists over GPT-2:

* pre-LN blocks, then a final LayerNorm *before* the last layer;
* the last layer is the *top query layer*: its attention queries come from a
  learned per-position query embedding (``wqe``) instead of the hidden states,
  while keys and values come from the (normalised) hidden states;
* the output projection is tied to the word embedding.

Parameter names follow the public PyTorch port of PanGu-α
(``GPTPanguForCausalLM``: ``transformer.wte/wpe/wqe``, ``transformer.h.{i}``
with ``ln_1``, ``attn.{q,k,v,c}_proj``, ``ln_2``, ``mlp.{c_fc,c_proj}``,
``transformer.ln_f``, ``lm_head``) so its checkpoints load as they are. As in
that port, ``num_layers`` counts the top query layer: ``h[-1]`` is it.

The model knows nothing about parties, LoRA or Flower; other modules slice
``model.transformer.h`` to cut it into segments. For generation, ``forward``
and ``hidden`` take a ``KVCache`` (keys and values of the positions already
seen), so that each new token costs one position; without one they run
exactly the training path.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PanguConfig:
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

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_heads {self.num_heads}; pick heads that divide it"
            )
        if self.num_layers < 1:
            raise ValueError(
                f"num_layers must be >= 1 (the top query layer), got {self.num_layers}"
            )
        for name in ("vocab_size", "hidden_size", "num_heads", "ffn_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PanguConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        # Types first: a string where a number belongs would otherwise fail in
        # __post_init__'s arithmetic with a message that names nothing.
        for f in fields(cls):
            if f.name not in d:
                continue
            value, want = d[f.name], type(f.default)
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if not (numeric and (want is float or isinstance(value, int))):
                kind = "an integer" if want is int else "a number"
                raise ValueError(f"{f.name} must be {kind}, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value!r}")
        return cls(**d)


# The reference's table (seed 000) plus CPU-sized presets for tests and demos.
CONFIGS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=8000,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        ffn_size=512,
        seq_len=128,
    ),
    "small": dict(
        vocab_size=8000,
        hidden_size=256,
        num_layers=6,
        num_heads=8,
        ffn_size=1024,
        seq_len=256,
    ),
    "350M": dict(hidden_size=1280, num_layers=16, num_heads=32, ffn_size=5120),
    "2.6B": dict(hidden_size=2560, num_layers=32, num_heads=32, ffn_size=10240),
    "13B": dict(hidden_size=5120, num_layers=40, num_heads=40, ffn_size=20480),
    "200B": dict(hidden_size=16384, num_layers=64, num_heads=128, ffn_size=65536),
}


def load_config(name_or_path: str | Path, **overrides) -> PanguConfig:
    """A preset name from ``CONFIGS`` or a JSON file of ``PanguConfig`` fields."""
    name = str(name_or_path)
    if name in CONFIGS:
        return PanguConfig(**{**CONFIGS[name], **overrides})
    path = Path(name)
    if not path.is_file():
        raise ValueError(
            f"model config {name!r} is neither a preset ({', '.join(CONFIGS)}) "
            "nor an existing JSON file"
        )
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a valid JSON model config ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: a model config must be a JSON object")
    # A run folder's config.json nests the model config under "model".
    d = d.get("model", d)
    try:
        return PanguConfig.from_dict({**d, **overrides})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


class LayerKV:
    """One layer's cached keys and values, (B, heads, capacity, head_dim) each.

    Preallocated to the generation's full length, so appending a position
    writes in place instead of copying every earlier one (as ``torch.cat``
    would, which makes a long generation quadratic in memory traffic).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
        self.length = 0  # positions filled

    def append(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
        """Store the new positions' ``k``/``v``; return the keys and values of
        every position so far, the attention mask and whether it is causal."""
        past, new = self.length, k.shape[2]
        end = past + new
        if end > self.keys.shape[2]:
            raise ValueError(
                f"KV cache holds {self.keys.shape[2]} positions; "
                f"{past} + {new} do not fit"
            )
        self.keys[:, :, past:end] = k
        self.values[:, :, past:end] = v
        self.length = end
        keys, values = self.keys[:, :, :end], self.values[:, :, :end]
        if past == 0:
            return keys, values, None, True  # the prompt: square and causal
        if new == 1:
            return keys, values, None, False  # one new position sees them all
        # Several new positions after cached ones: SDPA's is_causal aligns the
        # triangle top-left, so spell out that query i sees keys <= past + i.
        rows = torch.arange(past, end, device=k.device).unsqueeze(1)
        mask = torch.arange(end, device=k.device).unsqueeze(0) <= rows
        return keys, values, mask, False


class KVCache:
    """Keys and values of every layer (the top query layer's included) for the
    positions a model has seen, so that generating a token runs one position.

    Pass the same cache to successive ``PanguAlpha.forward(tokens, cache=...)``
    calls: the first with the prompt, then one call per new token. Positions
    continue from ``length``; ``capacity`` (at most ``seq_len``, the learned
    position embeddings' reach) bounds prompt + new tokens.
    """

    def __init__(
        self,
        cfg: PanguConfig,
        capacity: int,
        *,
        batch_size: int = 1,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not 1 <= capacity <= cfg.seq_len:
            raise ValueError(
                f"KV cache capacity must be in 1..{cfg.seq_len} (the model's "
                f"seq_len), got {capacity}"
            )
        shape = (batch_size, cfg.num_heads, capacity, cfg.head_dim)
        self.capacity = capacity
        self.layers = [
            LayerKV(
                torch.empty(shape, device=device, dtype=dtype),
                torch.empty(shape, device=device, dtype=dtype),
            )
            for _ in range(cfg.num_layers)
        ]

    @property
    def length(self) -> int:
        """Positions cached so far (the next token's position)."""
        return self.layers[-1].length


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
        causal = attn_mask is None
        if kv is not None:
            k, v, attn_mask, causal = kv.append(k, v)  # (B, nh, past + T, hd)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
        )  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: PanguConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.c_proj = nn.Linear(cfg.ffn_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block. With ``query`` given it is the top query layer."""

    def __init__(self, cfg: PanguConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        query: torch.Tensor | None = None,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask, query, kv)
        return x + self.mlp(self.ln_2(x))


def eod_reset_masks(
    tokens: torch.Tensor, eod_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention mask and position ids that restart after every EOD token:
    ``masks_from_documents`` of the tokens' ``document_index``."""
    return masks_from_documents(document_index(tokens, eod_id))


def document_index(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Per-position document index (B, T): the number of EODs strictly before
    it, so that an EOD belongs to the document it ends."""
    is_eod = (tokens == eod_id).to(torch.int64)
    return torch.cumsum(is_eod, dim=1) - is_eod


def masks_from_documents(doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention mask and position ids that restart with every document.

    The reference resets both at each end-of-document inside a packed sample, so
    no token attends across a document boundary. ``doc`` (B, T) is each
    position's ``document_index``: a party that must apply the reset but may not
    see the tokens (the split compute party) is given it instead of them.
    Returns a boolean mask of shape (B, 1, T, T) (True = may attend) and
    position ids of shape (B, T).
    """
    B, T = doc.shape
    same_doc = doc.unsqueeze(2) == doc.unsqueeze(1)  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    mask = (same_doc & causal).unsqueeze(1)
    # Position = index minus the index of the first token of its document.
    idx = torch.arange(T, device=doc.device).expand(B, T)
    start = torch.zeros(B, T, dtype=torch.int64, device=doc.device)
    start[:, 1:] = torch.where(doc[:, 1:] != doc[:, :-1], idx[:, 1:], 0)
    start = torch.cummax(start, dim=1).values
    return mask, idx - start


class PanguTransformer(nn.Module):
    """Embeddings, blocks and final LN; ``h[-1]`` is the top query layer."""

    def __init__(self, cfg: PanguConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.wqe = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` in a model initialised with
    ``seed``: HMAC-SHA256 keyed by the seed, over the name, cut to 63 bits.

    Keyed, so that the seeds of some parameters (what a split run's compute
    party is given for its own tensors) reveal neither the run's seed nor the
    seeds, hence the initial values, of any other parameter.
    """
    key = int(seed).to_bytes(32, "big", signed=True)
    digest = hmac.new(key, name.encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


class PanguAlpha(nn.Module):
    """PanGu-α language model (``GPTPanguForCausalLM`` layout)."""

    def __init__(self, cfg: PanguConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = PanguTransformer(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters(seed)

    def tie_weights(self) -> None:
        """Share the output projection with the word embedding.

        Call again after ``to_empty()`` (materialising a meta model), which
        replaces parameters one module at a time and so unties them.
        """
        self.lm_head.weight = self.transformer.wte.weight

    @torch.no_grad()
    def reset_parameters(
        self,
        seed: int = 0,
        names: Iterable[str] | None = None,
        *,
        seeds: dict[str, int] | None = None,
    ) -> None:
        """GPT-2 style init; residual projections scaled by 1/sqrt(2 * layers).

        Each parameter draws from its own generator, seeded by
        ``parameter_seed(seed, name)``, so a party that holds only some segments
        initialises them exactly as the whole model would, without building the
        rest. ``seeds`` (name -> generator seed) initialises just those
        parameters from seeds given by someone else: a compute party gets the
        seeds of its own tensors from the data party, never the run's seed.
        """
        if seeds is not None:
            wanted = set(seeds)
        else:
            wanted = set(names) if names is not None else None
        std = self.config.init_std
        for name, p in self.named_parameters():
            if wanted is not None and name not in wanted:
                continue
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                p.fill_(1.0)
            else:
                scale = (
                    1 / math.sqrt(2 * self.config.num_layers)
                    if name.endswith("c_proj.weight")
                    else 1.0
                )
                g = torch.Generator(device=p.device)
                g.manual_seed(
                    seeds[name] if seeds is not None else parameter_seed(seed, name)
                )
                p.normal_(0.0, std * scale, generator=g)

    # The three pieces below are the model's natural cut points; segments.py
    # composes them, forward() is the plain unsplit path.
    def embed(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Word + position embeddings. (B, T) -> (B, T, C).

        ``seq_len`` bounds positions, not tokens: a row of several sequences
        packed together (cloze candidates sharing a context) may be longer,
        given position ids that restart below ``seq_len``.
        """
        T = tokens.shape[1]
        limit = self.config.seq_len
        # Checked only for long rows, so the usual path never syncs on a device.
        if T > limit and (position_ids is None or int(position_ids.max()) >= limit):
            raise ValueError(
                f"sequence of {T} tokens exceeds the model's seq_len "
                f"{self.config.seq_len}"
            )
        if position_ids is None:
            position_ids = torch.arange(T, device=tokens.device).unsqueeze(0)
        x = self.transformer.wte(tokens) + self.transformer.wpe(position_ids)
        return self.transformer.drop(x)

    def top_query(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        """Final LN then the top query layer. (B, T, C) -> (B, T, C).

        With ``kv`` the top layer's keys and values (from the normalised hidden
        states) are cached like any block's; its queries are the query
        embeddings of ``position_ids``, the new positions.
        """
        T = x.shape[1]
        if position_ids is None:
            position_ids = torch.arange(T, device=x.device).unsqueeze(0)
        query = self.transformer.wqe(position_ids).expand(x.shape[0], -1, -1)
        x = self.transformer.ln_f(x)
        return self.transformer.h[-1](x, attn_mask, query, kv)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x)

    def hidden(
        self,
        tokens: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final hidden states (B, T, C), before the tied output projection.

        With ``cache``, ``tokens`` are the positions after the cached ones.
        """
        if cache is not None:
            return self._hidden_cached(tokens, cache, attn_mask, position_ids)
        x = self.embed(tokens, position_ids)
        for block in self.transformer.h[:-1]:
            x = block(x, attn_mask)
        return self.top_query(x, attn_mask, position_ids)

    def _hidden_cached(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        attn_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        if attn_mask is not None or position_ids is not None:
            # Positions continue the cache's and the mask is causal over it;
            # EOD-reset or packed rows are not what a cache decodes.
            raise ValueError("a KV cache takes neither attn_mask nor position_ids")
        start, T = cache.length, tokens.shape[1]
        if start + T > cache.capacity:
            raise ValueError(
                f"{start} cached + {T} new positions exceed the KV cache's "
                f"{cache.capacity} (the model's seq_len is {self.config.seq_len})"
            )
        positions = torch.arange(start, start + T, device=tokens.device).unsqueeze(0)
        x = self.embed(tokens, positions)
        blocks = self.transformer.h
        for block, kv in zip(blocks[:-1], cache.layers[:-1], strict=True):
            x = block(x, kv=kv)
        return self.top_query(x, position_ids=positions, kv=cache.layers[-1])

    def new_cache(self, capacity: int | None = None, batch_size: int = 1) -> KVCache:
        """An empty ``KVCache`` on this model's device and dtype, for up to
        ``capacity`` positions (default ``seq_len``)."""
        p = self.transformer.wte.weight
        return KVCache(
            self.config,
            self.config.seq_len if capacity is None else capacity,
            batch_size=batch_size,
            device=p.device,
            dtype=p.dtype,
        )

    def forward(
        self,
        tokens: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) for tokens (B, T); causal unless a mask is given.

        With ``cache`` (see ``KVCache``) only the new positions ``tokens`` run,
        attending to the cached ones, and the cache grows by them.
        """
        return self.logits(self.hidden(tokens, attn_mask, position_ids, cache))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weight counted once


def build_model(
    config: PanguConfig | str,
    *,
    device: str | torch.device | None = None,
    seed: int | None = None,
) -> PanguAlpha:
    """Build a model; ``device="meta"`` sizes any preset without allocating it."""
    cfg = load_config(config) if isinstance(config, str) else config
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            return PanguAlpha(cfg)
    model = PanguAlpha(cfg, seed=seed or 0)
    return model.to(device) if device is not None else model


def lm_loss(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean next-token cross-entropy over non-ignored targets (fp32 math)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=ignore_index,
    )

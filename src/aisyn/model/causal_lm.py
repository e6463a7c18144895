"""What every decoder-only model here shares: its cut points, its KV cache,
its masks, its loss and its seeded initialisation.

A model family (PanGu-α in ``pangu.py``, GPT-2 in ``gpt2.py``, Llama and
Qwen2 in ``llama.py``; registered in ``families.py``) subclasses ``CausalLM``
and supplies five pieces: ``embed`` (tokens to hidden states), ``block(i,
...)`` (ordinary block ``i``), ``finish`` (whatever runs after the last
ordinary block and before the vocabulary projection: a final norm, and for
PanGu-α its top query layer), ``logits`` and a ``Layout`` (the module paths of
those pieces). The generic paths below (``hidden``, ``forward``, the KV cache)
and the segments a partition cuts (``segments.py``) are written against those
pieces only, so the parties of a split run never ask which architecture they
hold.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from typing import Self

import torch
from torch import nn


@dataclass(frozen=True)
class Layout:
    """Where a model's cut points live, as module paths.

    ``embed``: the modules of the embedding stage; ``block``: the path of
    ordinary block ``i`` (a format string); ``head``: the modules that run
    after the last ordinary block, the output projection and (for a tied
    head) the word embedding it shares included. ``head_layers`` counts the
    attention layers inside the head (PanGu-α's top query layer), which keep
    keys and values in a KV cache like blocks do.
    """

    family: str
    num_blocks: int
    embed: tuple[str, ...]
    block: str
    head: tuple[str, ...]
    head_layers: int = 0
    head_label: str = "head"

    def block_path(self, i: int) -> str:
        return self.block.format(i=i)

    @property
    def num_layers(self) -> int:
        """Attention layers in all: the blocks and the head's own."""
        return self.num_blocks + self.head_layers


class ConfigDict:
    """``to_dict``/``from_dict`` of a model config dataclass. ``from_dict``
    refuses unknown keys, then runs ``check_dict`` (a family's own checks of
    the values, before its ``__post_init__``)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Self:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        cls.check_dict(d)
        return cls(**d)

    @classmethod
    def check_dict(cls, d: dict) -> None:
        """Nothing to check beyond ``__post_init__``'s checks by default."""


@dataclass
class Context:
    """What every layer of one forward pass needs besides the hidden states.

    ``attn_mask`` (B, 1, T, S) boolean, True = may attend, or None for plain
    causal attention; ``position_ids`` (B or 1, T), or None for 0..T-1;
    ``rotary`` the (cos, sin) tables of those positions for families with
    rotary embeddings, computed once per pass instead of once per layer.
    """

    attn_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None


class LayerKV:
    """One layer's cached keys and values, (B, kv_heads, capacity, head_dim).

    Preallocated to the generation's full length, so appending a position
    writes in place instead of copying every earlier one (as ``torch.cat``
    would, which makes a long generation quadratic in memory traffic).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
        self.length = 0  # positions filled

    @classmethod
    def empty(
        cls,
        cfg,
        capacity: int,
        batch_size: int,
        device: torch.device | str | None,
        dtype: torch.dtype,
    ) -> LayerKV:
        shape = (batch_size, cfg.num_kv_heads, capacity, cfg.head_dim)
        return cls(
            torch.empty(shape, device=device, dtype=dtype),
            torch.empty(shape, device=device, dtype=dtype),
        )

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
    """Keys and values of every attention layer (a head's own included) for
    the positions a model has seen, so that generating a token runs one
    position.

    Pass the same cache to successive ``CausalLM.forward(tokens, cache=...)``
    calls: the first with the prompt, then one call per new token. Positions
    continue from ``length``; ``capacity`` (at most ``seq_len``, the positions
    the model has) bounds prompt + new tokens.
    """

    def __init__(
        self,
        cfg,
        capacity: int,
        *,
        batch_size: int = 1,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        check_capacity(capacity, cfg.seq_len)
        self.capacity = capacity
        self.layers = [
            LayerKV.empty(cfg, capacity, batch_size, device, dtype)
            for _ in range(cfg.layout.num_layers)
        ]

    @property
    def length(self) -> int:
        """Positions cached so far (the next token's position)."""
        return self.layers[-1].length


def check_capacity(capacity: int, seq_len: int) -> None:
    if not 1 <= capacity <= seq_len:
        raise ValueError(
            f"KV cache capacity must be in 1..{seq_len} (the model's "
            f"seq_len), got {capacity}"
        )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    kv: LayerKV | None,
    dropout: float,
) -> torch.Tensor:
    """Scaled dot-product attention of (B, heads, T, hd) queries over keys and
    values with as many or fewer heads (grouped-query attention); causal
    unless ``attn_mask`` says otherwise. With ``kv`` the new keys and values
    are appended to the cache first and the queries see every cached one."""
    causal = attn_mask is None
    if kv is not None:
        k, v, attn_mask, causal = kv.append(k, v)
    return torch.nn.functional.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout,
        is_causal=causal,
        enable_gqa=k.shape[1] != q.shape[1],
    )


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


@torch.no_grad()
def seeded_init(
    model: nn.Module,
    std: float,
    seed: int,
    names: Iterable[str] | None,
    seeds: dict[str, int] | None,
    *,
    is_gain: Callable[[str], bool],
    scale_of: Callable[[str], float] = lambda name: 1.0,
) -> None:
    """Zero biases, unit norm gains (``is_gain``), every other weight drawn
    from N(0, (std * scale_of(name))²) (default: N(0, std²)) with its own
    generator.

    Each parameter draws from ``parameter_seed(seed, name)``, so a party that
    holds only some segments initialises them exactly as the whole model
    would, without building the rest. ``seeds`` (name -> generator seed)
    initialises just those parameters from seeds given by someone else: a
    compute party gets the seeds of its own tensors, never the run's seed.
    """
    if seeds is not None:
        wanted = set(seeds)
    else:
        wanted = set(names) if names is not None else None
    for name, p in model.named_parameters():
        if wanted is not None and name not in wanted:
            continue
        if name.endswith("bias"):
            p.zero_()
        elif is_gain(name):
            p.fill_(1.0)
        else:
            g = torch.Generator(device=p.device)
            g.manual_seed(
                seeds[name] if seeds is not None else parameter_seed(seed, name)
            )
            p.normal_(0.0, std * scale_of(name), generator=g)


class CausalLM(nn.Module):
    """A decoder-only language model cut at its natural points.

    Subclasses set ``self.config`` (with ``seq_len``, ``vocab_size``,
    ``num_kv_heads``, ``head_dim`` and ``layout``), usually through ``build``,
    and implement ``embed``, ``block``, ``finish``, ``tie_weights`` and
    ``reset_parameters``; ``logits`` unless it is the ``lm_head``; ``context``
    when layers need more than the mask and the positions.
    """

    config: object

    def build(self, cfg, seed: int, name: str, body: nn.Module) -> None:
        """Set ``config``, the family's ``body`` module under ``name`` (its
        transformers name) and an ``lm_head``; tie it (``tie_weights``), then
        initialise from ``seed`` unless the model is built on the meta
        device."""
        self.config = cfg
        setattr(self, name, body)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters(seed)

    # -- the pieces a family supplies ------------------------------------
    def embed(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def block(
        self, i: int, x: torch.Tensor, ctx: Context, kv: LayerKV | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def finish(
        self, x: torch.Tensor, ctx: Context, kvs: list[LayerKV] | None = None
    ) -> torch.Tensor:
        """After the last ordinary block, before ``logits``; ``kvs`` holds the
        caches of the head's own attention layers (``layout.head_layers``)."""
        raise NotImplementedError

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x)

    def context(
        self,
        T: int,
        attn_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        device: torch.device,
    ) -> Context:
        return Context(attn_mask, position_ids)

    # -- generic paths -----------------------------------------------------
    @property
    def layout(self) -> Layout:
        return self.config.layout

    def hidden(
        self,
        tokens: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final hidden states (B, T, C), before the output projection.

        With ``cache``, ``tokens`` are the positions after the cached ones.
        """
        if cache is not None:
            return self._hidden_cached(tokens, cache, attn_mask, position_ids)
        ctx = self.context(tokens.shape[1], attn_mask, position_ids, tokens.device)
        x = self.embed(tokens, position_ids)
        for i in range(self.layout.num_blocks):
            x = self.block(i, x, ctx)
        return self.finish(x, ctx)

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
        ctx = self.context(T, None, positions, tokens.device)
        x = self.embed(tokens, positions)
        n = self.layout.num_blocks
        for i in range(n):
            x = self.block(i, x, ctx, cache.layers[i])
        return self.finish(x, ctx, cache.layers[n:])

    def new_cache(self, capacity: int | None = None, batch_size: int = 1) -> KVCache:
        """An empty ``KVCache`` on this model's device and dtype, for up to
        ``capacity`` positions (default ``seq_len``)."""
        p = next(self.parameters())
        return KVCache(
            self.config,
            self.config.seq_len if capacity is None else capacity,
            batch_size=batch_size,
            device=p.device,
            dtype=p.dtype,
        )

    def forward(self, tokens: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Logits (B, T, V) of ``hidden``'s final hidden states, given what
        ``hidden`` takes: causal unless a mask is given; with ``cache`` (see
        ``KVCache``) only the new positions ``tokens`` run, attending to the
        cached ones, and the cache grows by them."""
        return self.logits(self.hidden(tokens, *args, **kwargs))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights once


def check_positions(T: int, position_ids: torch.Tensor | None, limit: int) -> None:
    """``limit`` (the model's seq_len) bounds positions, not tokens: a row of
    several sequences packed together (cloze candidates sharing a context)
    may be longer, given position ids that restart below ``limit``. Checked
    only for long rows, so the usual path never syncs on a device."""
    if T > limit and (position_ids is None or int(position_ids.max()) >= limit):
        raise ValueError(f"sequence of {T} tokens exceeds the model's seq_len {limit}")


def lm_loss(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean next-token cross-entropy over non-ignored targets (fp32 math)."""
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=ignore_index,
    )

"""The body GPT-2 and PanGu-α share: learned positions, pre-LN blocks of an
attention and a GELU MLP, a final LayerNorm, the head tied to the word
embedding, GPT-2's initialisation.

The two differ in their attention and PanGu-α's top query layer only, so each
family's module (``gpt2.py``, ``pangu.py``) supplies its attention and its
``finish``; what is left of the model is here, once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from aisyn.model.causal_lm import (
    CausalLM,
    Context,
    LayerKV,
    check_positions,
    seeded_init,
)


class GeluMLP(nn.Module):
    """The MLP of GPT-2 and PanGu-α: ``c_fc``, ``act``, ``c_proj``, dropout."""

    def __init__(self, h: int, ffn: int, act: Callable, p: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(h, ffn)
        self.c_proj = nn.Linear(ffn, h)
        self.act = act
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class PreLNBlock(nn.Module):
    """The pre-LN block of GPT-2 and PanGu-α: ``ln_1``, ``attn``, ``ln_2``,
    ``mlp``. What follows the mask is passed on to ``attn`` (the ``kv`` of a
    ``LayerKV``; PanGu-α's ``query`` too, given only to its top query layer)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, h: int, eps: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(h, eps=eps)
        self.attn = attn
        self.ln_2 = nn.LayerNorm(h, eps=eps)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, *args, **kwargs
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask, *args, **kwargs)
        return x + self.mlp(self.ln_2(x))


class GPTBody(nn.Module):
    """The ``transformer`` of GPT-2 and PanGu-α: word and learned position
    embeddings ``wte``/``wpe`` (with ``wqe``, PanGu-α's query embedding),
    ``num_layers`` pre-LN blocks ``h`` of ``attn(cfg)`` and a ``GeluMLP`` of
    ``act``, and the final LayerNorm ``ln_f``."""

    def __init__(
        self, cfg, attn: Callable, act: Callable, eps: float, wqe: bool = False
    ) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_size
        self.wte = nn.Embedding(cfg.vocab_size, h)
        self.wpe = nn.Embedding(cfg.seq_len, h)
        if wqe:
            self.wqe = nn.Embedding(cfg.seq_len, h)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(
            PreLNBlock(attn(cfg), GeluMLP(h, f, act, cfg.dropout), h, eps)
            for _ in range(cfg.num_layers)
        )
        self.ln_f = nn.LayerNorm(h, eps=eps)


class GPTLM(CausalLM):
    """GPT-2 and PanGu-α: a ``GPTBody`` named ``transformer``, the output
    projection tied to its word embedding, GPT-2's initialisation."""

    def __init__(self, cfg, seed: int, body: GPTBody) -> None:
        super().__init__()
        self.build(cfg, seed, "transformer", body)

    def tie_weights(self) -> None:
        """Share the output projection with the word embedding.

        Call again after ``to_empty()`` (materialising a meta model), which
        replaces parameters one module at a time and so unties them.
        """
        self.lm_head.weight = self.transformer.wte.weight

    def reset_parameters(
        self,
        seed: int = 0,
        names: Iterable[str] | None = None,
        *,
        seeds: dict[str, int] | None = None,
    ) -> None:
        """GPT-2 style init, residual projections (``c_proj``) scaled by
        1/sqrt(2 * layers), LayerNorm gains (``.ln_``) 1, one seeded generator
        per parameter (see ``seeded_init``)."""
        scale = 1 / math.sqrt(2 * self.config.num_layers)
        seeded_init(
            self,
            self.config.init_std,
            seed,
            names,
            seeds,
            is_gain=lambda n: ".ln_" in n,
            scale_of=lambda n: scale if n.endswith("c_proj.weight") else 1.0,
        )

    # The pieces below are the model's natural cut points; segments.py
    # composes them, CausalLM.hidden() is the plain unsplit path.
    def embed(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Word + learned position embeddings. (B, T) -> (B, T, C)."""
        t, T = self.transformer, tokens.shape[1]
        check_positions(T, position_ids, t.wpe.num_embeddings)
        if position_ids is None:
            position_ids = torch.arange(T, device=tokens.device).unsqueeze(0)
        return t.drop(t.wte(tokens) + t.wpe(position_ids))

    def block(
        self, i: int, x: torch.Tensor, ctx: Context, kv: LayerKV | None = None
    ) -> torch.Tensor:
        return self.transformer.h[i](x, ctx.attn_mask, kv=kv)

"""Llama and Qwen2 (``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` names):
rotary positions, RMSNorm, grouped-query attention, SwiGLU MLP, final
``norm``, tied or untied ``lm_head``. Qwen2 is Llama with biases on the q/k/v
projections, so one class serves both; the config (an ``HFConfig``, ``hf.py``)
says which.

Written here, not wrapped from ``transformers``: the cut points, the KV cache
and the per-parameter seeded init are then those of every family, and nothing
depends on ``transformers``' internal layer API, which changes between
releases. ``tests/model/test_hf.py`` checks the logits against
``transformers``' own implementation for each family.
"""

from __future__ import annotations

import torch
from torch import nn

from aisyn.model.causal_lm import (
    CausalLM,
    Context,
    LayerKV,
    attend,
    check_positions,
    seeded_init,
)
from aisyn.model.hf import ACTIVATIONS, HFConfig


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: HFConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            hd,
        )
        self.dropout = cfg.dropout
        qkv_bias = cfg.attention_bias or cfg.family == "qwen2"
        self.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=cfg.attention_bias)

    def forward(self, x, attn_mask, rotary, kv):
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(B, T, self.num_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, hd).transpose(1, 2)
        cos, sin = (t.to(q.dtype) for t in rotary)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = attend(q, k, v, attn_mask, kv, self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.num_heads * hd))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: HFConfig) -> None:
        super().__init__()
        h, f, b = cfg.hidden_size, cfg.ffn_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, f, bias=b)
        self.up_proj = nn.Linear(h, f, bias=b)
        self.down_proj = nn.Linear(f, h, bias=b)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: HFConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, attn_mask, rotary, kv=None):
        a = self.self_attn(self.input_layernorm(x), attn_mask, rotary, kv)
        x = x + self.resid_dropout(a)
        return x + self.resid_dropout(self.mlp(self.post_attention_layernorm(x)))


class LlamaModel(nn.Module):
    def __init__(self, cfg: HFConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)


class Llama(CausalLM):
    """Llama and Qwen2 (``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` names)."""

    def __init__(self, cfg: HFConfig, seed: int = 0) -> None:
        super().__init__()
        self.build(cfg, seed, "model", LlamaModel(cfg))

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_parameters(self, seed=0, names=None, *, seeds=None) -> None:
        std = self.config.init_std
        seeded_init(self, std, seed, names, seeds, is_gain=lambda n: "norm" in n)

    def context(self, T, attn_mask, position_ids, device):
        if position_ids is None:
            position_ids = torch.arange(T, device=device).unsqueeze(0)
        hd = self.config.head_dim
        # As transformers computes it: fp32 angles, cos/sin per position.
        inv_freq = 1.0 / (
            self.config.rope_theta
            ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd)
        )
        angles = position_ids.float().unsqueeze(-1) * inv_freq  # (B, T, hd/2)
        emb = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # (B, 1, T, hd)
        return Context(attn_mask, position_ids, (emb.cos(), emb.sin()))

    def embed(self, tokens, position_ids=None):
        # Rotary positions carry no table: seq_len bounds what was trained.
        check_positions(tokens.shape[1], position_ids, self.config.seq_len)
        return self.model.embed_tokens(tokens)

    def block(self, i, x, ctx: Context, kv: LayerKV | None = None):
        return self.model.layers[i](x, ctx.attn_mask, ctx.rotary, kv)

    def finish(self, x, ctx: Context, kvs=None):
        return self.model.norm(x)

"""GPT-2 (``GPT2LMHeadModel`` names): the GPT body (``gpt.py``) with a fused
``c_attn`` attention; learned positions, pre-LN blocks, tanh-GELU MLP, final
``ln_f``, head tied to ``wte``.

Its config is an ``HFConfig`` of family ``gpt2`` (``hf.py``, which also reads
and writes its ``save_pretrained`` folders: transformers keeps the
projections as ``Conv1D``, [in, out]; here they are ``nn.Linear``, [out, in],
what peft's LoRA and our optimizer expect, transposed at the folder
boundary). ``tests/model/test_hf.py`` checks the logits against
``transformers``' own implementation.
"""

from __future__ import annotations

from torch import nn

from aisyn.model.causal_lm import Context, attend
from aisyn.model.gpt import GPTLM, GPTBody
from aisyn.model.hf import ACTIVATIONS, HFConfig


class GPT2Attention(nn.Module):
    def __init__(self, cfg: HFConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.dropout = cfg.num_heads, cfg.dropout
        self.c_attn = nn.Linear(h, 3 * h)
        self.c_proj = nn.Linear(h, h)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, attn_mask, kv=None):
        B, T, C = x.shape
        nh = self.num_heads
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
        y = attend(q, k, v, attn_mask, kv, self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class GPT2(GPTLM):
    """GPT-2 (``GPT2LMHeadModel`` names)."""

    def __init__(self, cfg: HFConfig, seed: int = 0) -> None:
        act = ACTIVATIONS[cfg.activation]
        super().__init__(cfg, seed, GPTBody(cfg, GPT2Attention, act, cfg.norm_eps))

    def finish(self, x, ctx: Context, kvs=None):
        return self.transformer.ln_f(x)

"""The one optimizer update every regime takes (``train.update``)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from aisyn.train.update import SkippedStep, apply_update, grad_sq_norm


def _model_with_grads(scale: float = 1.0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model(torch.randn(5, 4)).pow(2).sum().mul(scale).backward()
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_clipping_is_clip_grad_norm_bit_for_bit():
    a, opt_a = _model_with_grads(100.0)
    b, opt_b = _model_with_grads(100.0)
    want = nn.utils.clip_grad_norm_(list(b.parameters()), 0.5)
    opt_b.step()
    got = apply_update(opt_a, list(a.parameters()), step=0, lr=0.1, grad_clip=0.5)
    assert got == float(want)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
        assert pa.grad is None  # zeroed


def test_a_global_norm_from_elsewhere_scales_like_the_local_one():
    a, opt_a = _model_with_grads(100.0)
    b, opt_b = _model_with_grads(100.0)
    norm = math.sqrt(grad_sq_norm(list(a.parameters())))
    apply_update(
        opt_a, list(a.parameters()), step=0, lr=0.1, grad_clip=0.5, total_norm=norm
    )
    apply_update(opt_b, list(b.parameters()), step=0, lr=0.1, grad_clip=0.5)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


def test_the_norm_is_reported_with_clipping_off():
    """sft_step used to record grad_norm only when clipping was on."""
    a, opt = _model_with_grads()
    want = float(torch.nn.utils.get_total_norm([p.grad for p in a.parameters()]))
    assert apply_update(opt, list(a.parameters()), step=0, lr=0.1, grad_clip=0) == want


@pytest.mark.parametrize(
    ("loss", "poison", "reason"),
    [
        (math.nan, None, "step 4: non-finite loss (nan)"),
        (1.0, math.inf, "step 4: non-finite gradient norm (inf)"),
        (1.0, math.nan, "step 4: non-finite gradient norm (nan)"),
    ],
)
def test_a_non_finite_loss_or_norm_skips_the_step(loss, poison, reason):
    model, opt = _model_with_grads()
    before = [p.detach().clone() for p in model.parameters()]
    if poison is not None:
        next(model.parameters()).grad[0, 0] = poison
    with pytest.raises(SkippedStep, match=re.escape(reason)) as info:
        apply_update(
            opt, list(model.parameters()), step=3, lr=0.1, grad_clip=1.0, loss=loss
        )
    assert "skipped the optimizer step and the last checkpoint is kept" in str(
        info.value
    )
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b) and p.grad is None

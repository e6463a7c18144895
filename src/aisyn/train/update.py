"""The one optimizer update every regime takes: lr, finiteness, clip, step, zero.

Standalone training, fine-tuning, a federated client's local steps and both
parties of a split run all end a step here, so they agree on what a bad step
is and on what happens then: a non-finite loss or gradient norm skips the
step -- the gradients are dropped, no weight moves, and ``SkippedStep`` says
which step and why, the same way everywhere. Nothing non-finite ever reaches
a weight (and ``checkpoint.save`` refuses one that did).

The clip is ``clip_grad_norm_``'s, bit for bit: with ``total_norm`` left out
the norm is taken as it takes it; a split party passes the *global* norm it
computed from both parties' squared norms (``grad_sq_norm`` + the peer's), so
each side scales its own gradients by the coefficient the unsplit model would
use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


class SkippedStep(FloatingPointError):
    """An optimizer step was skipped: a loss, gradient or value from a peer was
    not finite (or out of range). The message names the step and the reason."""

    @classmethod
    def at(cls, step: int, reason: str, *, both_parties: bool = False) -> SkippedStep:
        who = "both parties skipped" if both_parties else "skipped"
        return cls(
            f"step {step + 1}: {reason}; {who} the optimizer step and the last "
            "checkpoint is kept"
        )


def grad_sq_norm(params: Sequence[nn.Parameter]) -> float:
    """Sum of the squared L2 norms of the gradients of ``params``.

    Per-tensor norms as ``clip_grad_norm_`` takes them, summed in float64 so a
    global norm assembled from several holders' sums does not depend on how the
    parameters are split among them.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads])
    return float(norms.double().pow(2).sum())


def apply_update(
    optimizer: torch.optim.Optimizer,
    params: Sequence[nn.Parameter],
    *,
    step: int,
    lr: float,
    grad_clip: float,
    loss: float | None = None,
    total_norm: float | None = None,
    both_parties: bool = False,
    hint: str = " (lower --lr?)",
) -> float:
    """Set ``lr``, check, clip to ``grad_clip`` (0: off), step and zero the
    gradients; returns the gradient norm (global, when ``total_norm`` is given).

    Raises ``SkippedStep`` -- gradients dropped, weights untouched -- when
    ``loss`` or the norm is not finite.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    grads = [p.grad for p in params if p.grad is not None]
    if loss is not None and not math.isfinite(loss):
        optimizer.zero_grad(set_to_none=True)
        raise SkippedStep.at(
            step, f"non-finite loss ({loss}){hint}", both_parties=both_parties
        )
    norm_t = (
        torch.nn.utils.get_total_norm(grads)  # exactly as clip_grad_norm_
        if total_norm is None
        else None
    )
    if norm_t is not None and hasattr(norm_t, "full_tensor"):
        norm_t = norm_t.full_tensor()  # of FSDP2's sharded gradients: a DTensor
    norm = float(norm_t) if norm_t is not None else float(total_norm)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise SkippedStep.at(
            step, f"non-finite gradient norm ({norm}){hint}", both_parties=both_parties
        )
    if grad_clip > 0 and grads:
        if norm_t is not None:
            torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm_t)
        else:
            coef = min(grad_clip / (norm + 1e-6), 1.0)  # as clip_grad_norm_
            # (a party with FSDP2-sharded blocks holds DTensor gradients next
            # to plain ones, which one foreach call cannot mix)
            for kind in {type(g) for g in grads}:
                torch._foreach_mul_([g for g in grads if type(g) is kind], coef)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm

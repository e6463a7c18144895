"""End to end: one split-training step over a link equals the monolithic step.

Party A holds the embedding and head, party B the backbone; they exchange only
cut-layer activations, their gradients, and one scalar each for global
gradient-norm clipping -- the way aisyn.split drives the link.
"""

from __future__ import annotations

import threading

import pytest
import torch
from linkutil import open_pair
from torch import nn

from aisyn.link import Link, memory_pair

VOCAB, HIDDEN, SEQ, MICRO, MICRO_BATCHES = 50, 16, 6, 2, 3
MAX_NORM = 0.5


def make_model() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "embed": nn.Embedding(VOCAB, HIDDEN),
            "backbone": nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()),
            "head": nn.Linear(HIDDEN, VOCAB),
        }
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),) * 2
        for _ in range(MICRO_BATCHES)
    ]


def local_sq_norm(params) -> float:
    return float(sum(p.grad.pow(2).sum() for p in params))


def clip(params, total_norm: float) -> None:
    coef = min(1.0, MAX_NORM / (total_norm + 1e-6))
    for p in params:
        p.grad.mul_(coef)


def party_a(link: Link, model: nn.ModuleDict, step: int) -> None:
    params = [*model["embed"].parameters(), *model["head"].parameters()]
    hidden = []
    for m, (ids, _) in enumerate(batches()):  # all forwards in flight (pipelining)
        h = model["embed"](ids)
        hidden.append(h)
        link.send("act", h, step=step, micro=m)
    for m, (_, labels) in reversed(list(enumerate(batches()))):
        out = link.recv(
            "out",
            step=step,
            micro=m,
            shape=(MICRO, SEQ, HIDDEN),
            dtype=torch.float32,
            timeout=10,
        ).requires_grad_()
        loss = (
            nn.functional.cross_entropy(
                model["head"](out).flatten(0, 1), labels.flatten()
            )
            / MICRO_BATCHES
        )
        loss.backward()
        link.send("grad_out", out.grad, step=step, micro=m)
    for m in range(MICRO_BATCHES):
        grad_h = link.recv("grad_act", step=step, micro=m, timeout=10)
        hidden[m].backward(grad_h)
    mine = local_sq_norm(params)
    link.send_scalar("sq_norm", mine, step=step)
    clip(params, (mine + link.recv_scalar("sq_norm", step=step, timeout=10)) ** 0.5)


def party_b(link: Link, model: nn.ModuleDict, step: int) -> None:
    params = list(model["backbone"].parameters())
    inputs, outputs = {}, {}
    for m in range(MICRO_BATCHES):
        h = link.recv("act", step=step, micro=m, timeout=10).requires_grad_()
        inputs[m], outputs[m] = h, model["backbone"](h)
        link.send("out", outputs[m], step=step, micro=m)
    for m in reversed(range(MICRO_BATCHES)):
        grad_out = link.recv("grad_out", step=step, micro=m, timeout=10)
        outputs[m].backward(grad_out)
        link.send("grad_act", inputs[m].grad, step=step, micro=m)
    mine = local_sq_norm(params)
    link.send_scalar("sq_norm", mine, step=step)
    clip(params, (mine + link.recv_scalar("sq_norm", step=step, timeout=10)) ** 0.5)


def reference_grads() -> dict[str, torch.Tensor]:
    model = make_model()
    for ids, labels in batches():
        logits = model["head"](model["backbone"](model["embed"](ids)))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        (loss / MICRO_BATCHES).backward()
    nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return {name: p.grad for name, p in model.named_parameters()}


def run_split(a: Link, b: Link) -> dict[str, torch.Tensor]:
    model_a, model_b = make_model(), make_model()  # each uses only its own part
    errors: list[BaseException] = []

    def run_b() -> None:
        try:
            party_b(b, model_b, step=0)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    thread = threading.Thread(target=run_b)
    thread.start()
    party_a(a, model_a, step=0)
    thread.join(20)
    assert not errors and not thread.is_alive()
    grads = {n: p.grad for n, p in model_a.named_parameters() if p.grad is not None}
    grads.update({n: p.grad for n, p in model_b.named_parameters() if "backbone" in n})
    return grads


@pytest.mark.parametrize("transport", ["memory", "grpc"])
def test_split_step_matches_monolithic_step(transport, server):
    a, b = memory_pair() if transport == "memory" else open_pair(server)
    try:
        grads = run_split(a, b)
    finally:
        a.close()
        b.close()
    expected = reference_grads()
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, msg=name)

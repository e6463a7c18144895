"""Tenants' micro-batches through the one frozen base together
(``split.centre.tenant_batch``): each session's output and gradients are its solo
ones, the rows of sessions waiting at once share one forward and one
backward, and a session slow with its gradient holds nobody."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import replace

import pytest
import torch
from conftest import CUT
from test_finetune import LORA, ft_cfg

from aisyn.model.segments import COMPUTE_PARTY, parse_partition
from aisyn.split.backbone.compute_party import ComputeParty
from aisyn.split.centre.tenant_batch import AdapterBatcher
from aisyn.split.party import PartyState, place_weights

SEEDS = (1, 2, 3)


def sessions(ft_config, ft_base, ac: bool = False):
    party = ComputeParty(
        ft_config, parse_partition(CUT, ft_config), None, init_from=ft_base
    )
    party.batch_tenants = True
    frozen = party.frozen_base(ft_config)
    states = []
    for seed in SEEDS:
        state = PartyState(
            ft_config,
            party.partition,
            COMPUTE_PARTY,
            replace(ft_cfg(), activation_checkpointing=ac),
            torch.device("cpu"),
            method=LORA,
            lora_seeds={n: seed for n in party.lora_a_names(LORA)},
            frozen=frozen,
        )
        place_weights(state, party.base, None, fresh_train=True)
        with torch.no_grad():  # adapters that do something (B starts at zero)
            g = torch.Generator().manual_seed(seed)
            for n, p in state.named:
                if ".lora_B." in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        states.append(state)
    return party, states


def inputs(ft_config, T: int = 24):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, T, ft_config.hidden_size, generator=g) for _ in SEEDS]
    gs = [torch.randn(2, T, ft_config.hidden_size, generator=g) for _ in SEEDS]
    return xs, gs


def solo(state: PartyState, x: torch.Tensor, g: torch.Tensor):
    """One session's forward and backward on its own."""
    x = x.clone().requires_grad_()
    (middle,) = state.segments
    y = middle(x, None)
    torch.autograd.backward(y, g)
    grads = {n: p.grad.clone() for n, p in state.named}
    state.zero_grad()
    return y.detach(), x.grad, grads


class Gate:
    """A turn at B that holds the first one taken until told, so that the
    other sessions' micro-batches are waiting when it runs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = threading.Event()
        self.turns = 0

    @contextlib.contextmanager
    def turn(self):
        with self.lock:
            self.turns += 1
            self.open.wait(10)
            yield


@pytest.mark.parametrize("ac", [False, True], ids=["plain", "checkpointed"])
def test_sessions_waiting_together_share_one_pass_and_get_their_solo_results(
    ft_config, ft_base, ac
):
    party, states = sessions(ft_config, ft_base, ac)
    xs, gs = inputs(ft_config)
    expected = [solo(s, x, g) for s, x, g in zip(states, xs, gs, strict=True)]
    batcher = party.batcher_for(party_session(ac), states[0])
    assert isinstance(batcher, AdapterBatcher)
    gate = Gate()
    results: dict[int, tuple] = {}

    def run(i: int) -> None:
        s = states[i]
        x = xs[i].clone().requires_grad_()
        slot = batcher.forward(
            x,
            batcher.session_layers(s.model),
            [p for _, p in s.named],
            gate.turn,
            s.autocast,
        )
        y = slot.y.detach().clone()
        slot.backward(gs[i], gate.turn)
        results[i] = (y, x.grad, {n: p.grad.clone() for n, p in s.named})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # all three queued behind the first turn
    gate.open.set()
    for t in threads:
        t.join(30)
    assert sorted(results) == [0, 1, 2]
    assert batcher.batches == 1 and batcher.batched_rows == 3
    for (y, gx, grads), (y0, gx0, grads0) in zip(
        (results[i] for i in range(3)), expected, strict=True
    ):
        torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx, gx0, rtol=1e-5, atol=1e-6)
        for n in grads0:
            torch.testing.assert_close(grads[n], grads0[n], rtol=1e-5, atol=1e-7)


def test_a_session_slow_with_its_gradient_holds_nobody(ft_config, ft_base):
    party, states = sessions(ft_config, ft_base)
    xs, gs = inputs(ft_config)
    expected = [solo(s, x, g) for s, x, g in zip(states, xs, gs, strict=True)]
    batcher = party.batcher_for(party_session(False), states[0])
    batcher.straggler_s = 0.2
    gate = Gate()
    slots = {}
    leaves = {}

    def forward(i: int) -> None:
        s = states[i]
        leaves[i] = xs[i].clone().requires_grad_()
        slots[i] = batcher.forward(
            leaves[i],
            batcher.session_layers(s.model),
            [p for _, p in s.named],
            gate.turn,
            s.autocast,
        )

    threads = [threading.Thread(target=forward, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    gate.open.set()
    for t in threads:
        t.join(30)
    assert batcher.batches == 1
    # Session 2 never sends its gradient (its data party is gone): 0 and 1
    # wait no longer than the straggler bound, then go on alone.
    t0 = time.perf_counter()
    done = [
        threading.Thread(target=slots[i].backward, args=(gs[i], gate.turn))
        for i in (0, 1)
    ]
    for t in done:
        t.start()
    for t in done:
        t.join(30)
    assert time.perf_counter() - t0 < 5
    for i in (0, 1):
        torch.testing.assert_close(leaves[i].grad, expected[i][1], rtol=1e-5, atol=1e-6)
        for n, p in states[i].named:
            torch.testing.assert_close(p.grad, expected[i][2][n], rtol=1e-5, atol=1e-7)
    # Nothing reached the absent session's tensors, not even zeros.
    assert leaves[2].grad is None
    assert all(p.grad is None for _, p in states[2].named)
    # It comes back late: its own rows, through the graph kept for it.
    slots[2].backward(gs[2], gate.turn)
    torch.testing.assert_close(leaves[2].grad, expected[2][1], rtol=1e-5, atol=1e-6)


def party_session(ac: bool):
    from aisyn.split.backbone.compute_party import Session

    return Session("train", "r1", replace(ft_cfg(), activation_checkpointing=ac), 0)


def test_many_sessions_racing_for_two_turns_each_get_their_own_results(
    ft_config, ft_base
):
    """Sessions that keep sending micro-batches while two turns run at once
    (the fair share's slots): whichever turn takes a micro-batch, each
    session gets back exactly its own rows, many times over."""
    from aisyn.split.centre.fair_share import FairShare

    party, states = sessions(ft_config, ft_base)
    batcher = party.batcher_for(party_session(False), states[0])
    fair = FairShare(slots=2)
    rounds = 6
    g = torch.Generator().manual_seed(3)
    work = {
        (i, k): (
            torch.randn(1, 16, ft_config.hidden_size, generator=g),
            torch.randn(1, 16, ft_config.hidden_size, generator=g),
        )
        for i in range(3)
        for k in range(rounds)
    }
    expected = {key: solo(states[key[0]], x, gr)[:2] for key, (x, gr) in work.items()}
    got, errors = {}, []

    def run(i: int) -> None:
        s = states[i]
        try:
            for k in range(rounds):
                x, gr = work[i, k]
                x = x.clone().requires_grad_()
                turn = lambda: fair.turn(f"t{i}", 1.0)  # noqa: E731
                slot = batcher.forward(
                    x, batcher.session_layers(s.model), [p for _, p in s.named],
                    turn, s.autocast,
                )  # fmt: skip
                y = slot.y.detach().clone()
                slot.backward(gr, turn)
                got[i, k] = (y, x.grad)
                s.zero_grad()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(got) == len(work)
    for key, (y, gx) in got.items():
        torch.testing.assert_close(y, expected[key][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx, expected[key][1], rtol=1e-5, atol=1e-6)

"""The order in which each party runs its per-micro-batch work in one step.

Ops (``kind``, micro-batch):

* party A: ``F`` embedding + front blocks, send the activation; ``L`` receive
  B's output, back blocks + head + loss, backward, send the gradient;
  ``B`` receive the gradient of its activation, backward through the front.
* party B: ``F`` receive the activation, middle blocks, send the output;
  ``B`` receive the output's gradient, backward, send the input's gradient.

Dependencies across parties: B.F(i) <- A.F(i); A.L(i) <- B.F(i);
B.B(i) <- A.L(i); A.B(i) <- B.B(i).

*Lockstep* runs one micro-batch end to end before the next, so at any moment
one party computes and the other waits (the reference's behaviour).
*Pipelined* (1F1B-style) keeps ``window`` micro-batches in flight: A runs the
front of micro-batch i+window while B runs the middle of i, and B runs the
forward of i+1 while A computes the loss of i. Each party's list is fixed, so
gradients accumulate in the same order every run (reproducible), and every
list is a valid order: :func:`simulate` proves the pair never deadlocks for
the sizes tests try.
"""

from __future__ import annotations

from typing import NamedTuple

Op = tuple[str, int]  # (kind, micro-batch)


class Schedule(NamedTuple):
    a: list[Op]
    b: list[Op]


def lockstep(micro_batches: int) -> Schedule:
    a: list[Op] = []
    b: list[Op] = []
    for i in range(micro_batches):
        a += [("F", i), ("L", i), ("B", i)]
        b += [("F", i), ("B", i)]
    return Schedule(a, b)


def pipelined(micro_batches: int, window: int = 2) -> Schedule:
    """1F1B-style orders with up to ``window`` micro-batches ahead of the loss."""
    if window < 1:
        raise ValueError(f"pipeline window must be >= 1, got {window}")
    m = micro_batches
    w = min(window, m)
    a: list[Op] = [("F", i) for i in range(w)]
    b: list[Op] = [("F", i) for i in range(w)]
    for i in range(m):
        # A: loss of i while B runs the forward of i+1; then feed B the next
        # micro-batch; then the front's backward of i-1, whose gradient B sent
        # while A was busy with the loss.
        a.append(("L", i))
        if i + w < m:
            a.append(("F", i + w))
        if i >= 1:
            a.append(("B", i - 1))
        b.append(("B", i))
        if i + w < m:
            b.append(("F", i + w))
    if m:
        a.append(("B", m - 1))
    return Schedule(a, b)


def make(micro_batches: int, window: int) -> Schedule:
    """``window`` 0: lockstep; >= 1: pipelined with that many in flight."""
    return lockstep(micro_batches) if window == 0 else pipelined(micro_batches, window)


_NEEDS = {
    ("b", "F"): ("a", "F"),
    ("a", "L"): ("b", "F"),
    ("b", "B"): ("a", "L"),
    ("a", "B"): ("b", "B"),
}


def simulate(schedule: Schedule, micro_batches: int) -> list[tuple[str, Op]]:
    """Run both lists against the cross-party dependencies; returns the global
    order. Raises RuntimeError on a deadlock or a missing/duplicate op."""
    expected_a = {(k, i) for k in "FLB" for i in range(micro_batches)}
    expected_b = {(k, i) for k in "FB" for i in range(micro_batches)}
    if sorted(schedule.a) != sorted(expected_a) or sorted(schedule.b) != sorted(
        expected_b
    ):
        raise RuntimeError("schedule does not run every op exactly once")
    done: set[tuple[str, str, int]] = set()
    pos = {"a": 0, "b": 0}
    lists = {"a": schedule.a, "b": schedule.b}
    order: list[tuple[str, Op]] = []
    while pos["a"] < len(schedule.a) or pos["b"] < len(schedule.b):
        progressed = False
        for party in ("a", "b"):
            if pos[party] == len(lists[party]):
                continue
            kind, i = lists[party][pos[party]]
            need = _NEEDS.get((party, kind))
            if need is None or (need[0], need[1], i) in done:
                done.add((party, kind, i))
                order.append((party, (kind, i)))
                pos[party] += 1
                progressed = True
        if not progressed:
            at = {
                p: lists[p][pos[p]] if pos[p] < len(lists[p]) else None
                for p in ("a", "b")
            }
            raise RuntimeError(f"deadlock: A waits at {at['a']}, B waits at {at['b']}")
    return order

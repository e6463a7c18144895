"""Every schedule runs each op once and never deadlocks the two parties."""

from __future__ import annotations

import pytest

from aisyn.split import schedule


@pytest.mark.parametrize("micro", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("window", [0, 1, 2, 3, 5])
def test_schedules_are_complete_and_deadlock_free(micro, window):
    s = schedule.make(micro, window)
    order = schedule.simulate(s, micro)
    assert len(order) == 5 * micro
    # Gradients accumulate in micro-batch order on both sides (reproducible,
    # and the unsplit loop's order).
    for ops in (s.a, s.b):
        for kind in "LB":
            seq = [i for k, i in ops if k == kind]
            assert seq == sorted(seq)


def test_pipelined_overlaps_and_lockstep_does_not():
    lock = schedule.lockstep(4)
    assert lock.a[:3] == [("F", 0), ("L", 0), ("B", 0)]
    pipe = schedule.pipelined(4, window=2)
    # A feeds micro-batch 1 before it needs B's output of 0, so B can compute
    # the middle of 1 while A computes the loss of 0.
    assert pipe.a.index(("F", 1)) < pipe.a.index(("L", 0))
    assert pipe.b.index(("F", 1)) < pipe.b.index(("B", 0))


def test_simulator_catches_a_deadlock():
    bad = schedule.Schedule(a=[("L", 0), ("F", 0), ("B", 0)], b=[("F", 0), ("B", 0)])
    with pytest.raises(RuntimeError, match="deadlock"):
        schedule.simulate(bad, 1)

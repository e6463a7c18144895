"""B's compute shared among tenants by weight (``split.centre.fair_share``): under
contention each tenant's share of the compute follows its weight, however
many sessions it runs; a tenant idle for a while cannot then starve the
others; and with more than one slot, turns run at once."""

from __future__ import annotations

import threading
import time

import pytest

from aisyn.split.centre.fair_share import FairShare


def contend(share: FairShare, sessions: dict[str, tuple[float, int]], seconds: float):
    """Each tenant's sessions (weight, count) take 5 ms turns for ``seconds``;
    the compute each tenant got."""
    got: dict[str, float] = {t: 0.0 for t in sessions}
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def session(tenant: str, weight: float) -> None:
        while time.monotonic() < stop:
            with share.turn(tenant, weight):
                t0 = time.perf_counter()
                time.sleep(0.005)
                used = time.perf_counter() - t0
            with lock:
                got[tenant] += used

    threads = [
        threading.Thread(target=session, args=(t, w))
        for t, (w, n) in sessions.items()
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 10)
    return got


@pytest.mark.heavy
def test_shares_follow_the_weights():
    # both always have a turn waiting (two sessions each): b weighs 3 times a
    got = contend(FairShare(slots=1), {"a": (1.0, 2), "b": (3.0, 2)}, 1.5)
    assert got["b"] / got["a"] == pytest.approx(3.0, rel=0.2)


@pytest.mark.heavy
def test_more_sessions_buy_no_larger_share():
    got = contend(
        FairShare(slots=1), {"a": (1.0, 4), "b": (1.0, 2), "c": (1.0, 2)}, 1.5
    )
    total = sum(got.values())
    assert all(v / total == pytest.approx(1 / 3, rel=0.2) for v in got.values()), got


def test_a_tenant_back_from_idle_cannot_starve_the_others():
    share = FairShare(slots=1)
    with share.turn("late", 1.0):
        pass  # it used next to nothing, long ago
    # b has used a lot meanwhile
    got = contend(share, {"busy": (1.0, 1)}, 0.3)
    assert got["busy"] > 0.2
    # now both contend: "late" starts level with "busy", not 0.3 s ahead
    got = contend(share, {"busy": (1.0, 2), "late": (1.0, 2)}, 0.6)
    assert got["busy"] / got["late"] == pytest.approx(1.0, rel=0.3)


def test_two_slots_run_two_turns_at_once():
    share = FairShare(slots=2)
    inside = threading.Barrier(2, timeout=5)

    def session(tenant: str) -> None:
        with share.turn(tenant, 1.0):
            inside.wait()  # both must be inside together

    threads = [threading.Thread(target=session, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not inside.broken

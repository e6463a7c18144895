"""B's compute, shared among tenants by weight: weighted fair queuing.

Every session of a compute centre runs on a thread of its own; left to the
operating system, each *session* would get an equal share of the cores, so a
tenant with four sessions would take four times a tenant with one, and
weights would mean nothing. Instead each piece of B's compute (one
micro-batch's forward, one backward) takes a turn: at most ``slots`` run at
once, and the next turn goes to the waiting tenant whose *virtual time* --
the compute seconds it has used, divided by its weight -- is least (start-time
fair queuing, as in Linux's CFS or a network scheduler's WFQ). So when B is
the bottleneck, tenants' shares of its compute follow their weights; when it
is not, nobody waits. A tenant that was idle starts again at the least
virtual time of those active, so it cannot bank idle time and then starve
the others.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


def default_slots() -> int:
    """One turn per group of torch's intra-op threads the cores hold."""
    import torch

    return max(1, (os.cpu_count() or 1) // max(1, torch.get_num_threads()))


class FairShare:
    def __init__(self, slots: int | None = None) -> None:
        self.slots = slots or default_slots()
        self._cond = threading.Condition()
        self._busy = 0
        #: tenant -> compute seconds used / weight
        self._vtime: dict[str, float] = {}
        #: (virtual time, arrival) of each turn waiting, by its ticket
        self._waiting: dict[int, tuple[float, int]] = {}
        self._running: dict[str, int] = {}
        self._arrival = itertools.count()

    @contextmanager
    def turn(self, tenant: str, weight: float) -> Iterator[None]:
        """Wait for ``tenant``'s turn, run the block, charge it its time."""
        with self._cond:
            ticket = next(self._arrival)
            self._waiting[ticket] = (self._start(tenant), ticket)
            while not (self._busy < self.slots and self._next() == ticket):
                self._cond.wait()
            del self._waiting[ticket]
            self._busy += 1
            self._running[tenant] = self._running.get(tenant, 0) + 1
            self._cond.notify_all()  # another slot may be free for the next
        t0 = time.perf_counter()
        try:
            yield
        finally:
            used = time.perf_counter() - t0
            with self._cond:
                self._busy -= 1
                self._running[tenant] -= 1
                self._vtime[tenant] = self._vtime.get(tenant, 0.0) + used / weight
                self._cond.notify_all()

    def _start(self, tenant: str) -> float:
        """The virtual time a turn of ``tenant`` queues with: its own, or the
        least of the active tenants' if it fell behind while idle."""
        active = [
            self._vtime.get(t, 0.0)
            for t, n in self._running.items()
            if n and t != tenant
        ] + [v for v, _ in self._waiting.values()]
        mine = self._vtime.get(tenant, 0.0)
        if active and mine < min(active):
            mine = self._vtime[tenant] = min(active)
        return mine

    def _next(self) -> int | None:
        if not self._waiting:
            return None
        return min(self._waiting, key=self._waiting.__getitem__)

    def used(self) -> dict[str, float]:
        """Each tenant's virtual time (for tests and logs)."""
        with self._cond:
            return dict(self._vtime)

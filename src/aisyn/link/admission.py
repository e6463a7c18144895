"""Who gets a link server's session slots next: a fair queue by identity.

Without it, a freed slot went to whichever caller happened to retry first,
so one credential holder that reconnects at once -- a hello, silence, dropped,
again -- could keep every other data party out until their connect timeouts
ran out, each told only "busy".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["AdmissionQueue"]


class AdmissionQueue:
    """``capacity`` session slots (one by default), handed out in order of
    arrival by identity.

    A caller turned away while every slot is held (or while others wait) is
    queued under its identity (``PeerHello.identity``: its certificate or
    token) and keeps its place as long as it keeps asking -- a caller silent
    for ``forget_s`` gave up and is dropped from the queue. When a slot is
    free, only the identity at the head may take it. So an identity that held
    a slot and reconnects goes behind everyone who waited meanwhile. Callers
    sharing an identity (one token, no client certificates) share one place.
    """

    def __init__(
        self,
        forget_s: float = 5.0,
        capacity: int = 1,
        max_waiting: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._forget_s = forget_s
        self._max_waiting = max_waiting
        self._clock = clock
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._lock = threading.Lock()
        #: who holds the slots now (by object identity)
        self._holders: list[object] = []
        #: identity -> when it last asked, in order of arrival
        self._waiting: dict[str, float] = {}

    def claim(self, identity: str, holder: object) -> int:
        """0 if ``identity`` now holds the slot (as ``holder``), else its place
        in the queue (1: next)."""
        with self._lock:
            now = self._clock()
            for waiting, asked in list(self._waiting.items()):
                if now - asked > self._forget_s:
                    del self._waiting[waiting]
            head = next(iter(self._waiting), None)
            if len(self._holders) < self._capacity and head in (None, identity):
                self._waiting.pop(identity, None)
                self._holders.append(holder)
                return 0
            if identity in self._waiting or len(self._waiting) < self._max_waiting:
                self._waiting[identity] = now  # an update keeps its place
                return list(self._waiting).index(identity) + 1
            return len(self._waiting) + 1  # a full queue: told, not queued

    def hand_over(self, old: object, new: object) -> bool:
        """A slot's holder ``old`` becomes ``new`` (the handshake's ticket,
        the session's link); False if ``old`` holds none."""
        with self._lock:
            for i, held in enumerate(self._holders):
                if held is old:
                    self._holders[i] = new
                    return True
            return False

    def release(self, holder: object) -> None:
        """Free ``holder``'s slot if it holds one (a no-op otherwise)."""
        with self._lock:
            self._holders = [h for h in self._holders if h is not holder]

    def held(self) -> int:
        """How many slots are held now."""
        with self._lock:
            return len(self._holders)

    def waiting(self) -> list[str]:
        """The identities queued now, in order (for logs and tests)."""
        with self._lock:
            return list(self._waiting)

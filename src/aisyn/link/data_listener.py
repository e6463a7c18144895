"""The server's data-plane port: who gets to attach, and at what cost to B.

A data-plane port is open to anyone who can reach it, before any credential
is shown: the certificate is checked in the TLS handshake and the secret in
the preamble after it. So whatever a connection holds before that must be
bounded, and no number of connections that never authenticate may keep the
session's own client out. A thread per handshake with a refusal at a cap
failed both ways: four silent dials from the client's own address (or 64
from 16 loopback addresses) filled the caps, and every later dial -- the
honest client's included -- was dropped at once.

Here every unauthenticated connection is driven by one event-loop thread
(non-blocking TLS handshake, then the preamble), and a connection that has
sent nothing yet holds only its socket: no TLS object, no buffer. When the
connections pending at once reach ``max_pending``, the new one is kept and
an old one goes instead, chosen so that a flood pays first:

1. from the address (an IPv6 /64: one host's share) with the most pending;
2. among those, one that has sent nothing (for a second or more: one just
   accepted has had no chance to) before one mid-handshake;
3. the oldest first.

An honest client dials, handshakes and sends its preamble within a few round
trips; to push it out, a flood would have to bring ``max_pending`` fresh
connections to bear within that time, from more addresses than the client's
share. The loop accepts at most an eighth of the cap per turn, so that
takes more turns than the client's few (at up to 64 a turn, a stream of new
dials pushed the client out at a cap of 64 or less). Each pending connection
still gets the handshake timeout in all.

File descriptors are what a flood of idle connections exhausts first; the
listener raises its process's soft limit towards the hard one so that
``max_pending`` fit beside everything else, lowers ``max_pending`` where they
do not, and never stops accepting when the limit is hit anyway (it drops the
oldest pending connection to make room).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hmac
import ipaddress
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable

from aisyn.net import split_host_port

from .certs import TlsConfig
from .data_plane import (
    _ACK,
    _PREAMBLE,
    DOWN,
    MAGIC,
    UP,
    _tune,
    certificate_identity,
    new_secret,
    tls_context,
)
from .errors import HandshakeError, LinkError
from .limits import ensure_fd_headroom

log = logging.getLogger(__name__)

#: unauthenticated connections held at once, by default (an idle one costs a
#: socket; one mid-handshake also its TLS state, tens of KiB)
MAX_PENDING = 1024
#: how long a new connection may stay silent before it counts as idle (and so
#: goes before those mid-handshake): an honest client's ClientHello follows
#: its connect within a round trip, but the loop may accept more dials before
#: it reads that. Without it a flood of one-byte connections pushed out every
#: newly accepted one -- the honest client's -- with a single further dial.
IDLE_GRACE_S = 1.0
#: how often at most a flood is reported (one line with the counts)
_REPORT_EVERY_S = 60.0
#: refused connections (a whole preamble, but wrong) logged one by one in
#: each report's period; the rest only counted
_LOUD_REFUSALS = 5
#: connections the kernel queues for accept(): a burst of dials waits there
#: rather than retrying its SYN a second later
_BACKLOG = 1024
#: connections accepted per wake-up before pending work is served again (at
#: most; an eighth of the cap where that is less)
_ACCEPT_BATCH = 64
#: accept() failures that mean "no descriptor or memory for one more"
_OUT_OF_ROOM = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class _Expected:
    """One session's data plane while its two connections come in."""

    def __init__(self, secret: bytes, identity: str) -> None:
        self.secret = secret
        self.identity = identity
        self.socks: dict[bytes, socket.socket] = {}
        self.cond = threading.Condition()
        self.cancelled = False


class _Pending:
    """One connection that has not authenticated yet."""

    __slots__ = (
        "accepted",
        "addr",
        "deadline",
        "fd",
        "group",
        "got",
        "preamble",
        "sock",
        "started",
    )

    def __init__(
        self, sock: socket.socket, addr: object, accepted: float, deadline: float
    ) -> None:
        self.sock = sock  # the raw socket, then its TLS wrapper (same descriptor)
        self.fd = sock.fileno()
        self.addr = addr
        self.group = address_group(addr)
        self.accepted = accepted
        self.deadline = deadline
        self.started = False  # it has sent something (a handshake under way)
        self.preamble: bytearray | None = None  # allocated once TLS is up
        self.got = 0


def address_group(addr: object) -> str:
    """Whose share a connection counts against: its IPv4 address, or its
    IPv6 /64 (the block one host is commonly given)."""
    host = addr[0] if isinstance(addr, tuple) else str(addr)
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class DataListener:
    """The server's data-plane port, shared by its sessions."""

    def __init__(
        self,
        listen: str,
        tls: TlsConfig | None,
        timeout: float,
        *,
        max_pending: int = MAX_PENDING,
    ) -> None:
        if max_pending < 2:
            raise ValueError(f"max_pending must be >= 2, got {max_pending}")
        host, port = split_host_port(listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server(
                (host, port), family=family, backlog=_BACKLOG
            )
        except OSError as exc:
            raise LinkError(
                f"cannot listen on {listen} for the data plane: {exc}"
            ) from None
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._ctx = tls_context(tls, server=True) if tls is not None else None
        self._timeout = timeout
        #: each pending connection holds one descriptor
        self.max_pending: int = ensure_fd_headroom(max_pending, "the data plane")
        #: accepted per wake-up: an eighth of the cap at most, so that a
        #: client's few turns of handshake see fewer newcomers than the cap
        #: (each newcomer at the cap pushes out one of the oldest)
        self._accept_batch = max(1, min(_ACCEPT_BATCH, self.max_pending // 8))
        self._lock = threading.Lock()
        self._expected: list[_Expected] = []
        # Event-loop state, touched by the loop thread only.
        self._pending: collections.OrderedDict[int, _Pending] = (
            collections.OrderedDict()
        )  # by fd, oldest first (so also by deadline)
        self._by_group: dict[str, collections.OrderedDict[int, _Pending]] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        #: what a flood cost since the last report (for one line a minute)
        self._evicted = self._timed_out = self._failed = self._refused = 0
        self._peak = 0
        self._last_report = time.monotonic()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._loop, name="data-plane-accept", daemon=True
        )
        self._thread.start()

    # -- the sessions' side (any thread)

    def expect(self, identity: str) -> tuple[bytes, _Expected]:
        """Register a session about to be offered the plane: (secret, handle)."""
        expected = _Expected(new_secret(), identity)
        with self._lock:
            self._expected.append(expected)
        return expected.secret, expected

    def wait(
        self, expected: _Expected, timeout: float, gone: Callable[[], bool]
    ) -> tuple[socket.socket, socket.socket]:
        """Both of the session's connections (up, down), or HandshakeError."""
        deadline = time.monotonic() + timeout
        try:
            with expected.cond:
                while len(expected.socks) < 2:
                    left = deadline - time.monotonic()
                    if left <= 0 or gone() or self._stopped:
                        why = "the session ended" if gone() else f"{timeout:g} s"
                        raise HandshakeError(
                            "the client did not open its data-plane connections "
                            f"(port {self.port}) within {why}"
                        )
                    expected.cond.wait(min(left, 0.1))
                return expected.socks[UP], expected.socks[DOWN]
        except BaseException:
            self.forget(expected)
            raise
        finally:
            with self._lock:
                if expected in self._expected:
                    self._expected.remove(expected)

    def forget(self, expected: _Expected) -> None:
        with self._lock:
            if expected in self._expected:
                self._expected.remove(expected)
        with expected.cond:
            expected.cancelled = True
            for sock in expected.socks.values():
                sock.close()
            expected.socks.clear()

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(5.0)

    def pending(self) -> int:
        """Unauthenticated connections held now (for tests and logs)."""
        return len(self._pending)

    @property
    def peak_pending(self) -> int:
        """The most unauthenticated connections ever held at once."""
        return self._peak

    # -- the event loop (its own thread)

    def _loop(self) -> None:
        try:
            while not self._stopped:
                now = time.monotonic()
                self._expire(now)
                self._report(now)
                wait = (
                    self._timeout
                    if not self._pending
                    else (next(iter(self._pending.values())).deadline - now)
                )
                for key, _events in self._selector.select(max(0.0, min(wait, 1.0))):
                    try:
                        if key.fileobj is self._sock:
                            self._accept()
                        elif key.fileobj is self._wake_r:
                            with contextlib.suppress(OSError):
                                self._wake_r.recv(64)
                        else:
                            self._advance(key.data)
                    except Exception:  # a bug must cost one connection, not the port
                        log.exception("data plane: the listener failed on one event")
                        if isinstance(key.data, _Pending):
                            self._drop(key.data)
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._selector.close()
            self._sock.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self) -> None:
        for _ in range(self._accept_batch):
            try:
                conn, addr = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_ROOM:
                    # Out of descriptors: make room rather than stop accepting
                    # (the kernel keeps the backlog; the next wake-up takes it).
                    victim = self._victim(None)
                    if victim is None:
                        time.sleep(0.05)
                    else:
                        self._evicted += 1
                        self._drop(victim)
                    return
                if self._stopped:
                    return
                continue  # e.g. ECONNABORTED: that one caller is gone
            conn.setblocking(False)
            now = time.monotonic()
            pending = _Pending(conn, addr, now, now + self._timeout)
            if len(self._pending) >= self.max_pending:
                victim = self._victim(pending.group)
                if victim is not None:
                    self._evicted += 1
                    self._drop(victim)
            self._pending[pending.fd] = pending
            group = self._by_group.setdefault(pending.group, collections.OrderedDict())
            group[pending.fd] = pending
            self._peak = max(self._peak, len(self._pending))
            self._selector.register(conn, selectors.EVENT_READ, pending)

    def _victim(self, arriving_group: str | None) -> _Pending | None:
        """The pending connection to drop for a new one (see the module's doc)."""
        if not self._pending:
            return None

        # The new connection counts towards its own address's share: an
        # address that already holds as many as the heaviest loses first.
        def share(group: str) -> int:
            return len(self._by_group[group]) + (group == arriving_group)

        heaviest = max(self._by_group, key=share)
        if share(heaviest) <= 1:  # every address holds one: the oldest overall
            candidates = self._pending
        else:
            candidates = self._by_group[heaviest]
        # Silent past the grace: it had its chance to speak. One accepted a
        # moment ago has not (it may be the honest client's); it goes by age.
        silent_since = time.monotonic() - min(IDLE_GRACE_S, self._timeout / 2)
        idle = next(
            (
                p
                for p in candidates.values()
                if not p.started and p.accepted <= silent_since
            ),
            None,
        )
        return idle or next(iter(candidates.values()))

    def _expire(self, now: float) -> None:
        # Oldest first, and every connection gets the same timeout: the
        # expired ones are a prefix.
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                return
            self._timed_out += 1
            log.debug("data plane: %s did not authenticate in time", oldest.addr)
            self._drop(oldest)

    def _forget_pending(self, pending: _Pending) -> None:
        if self._pending.get(pending.fd) is not pending:
            return  # already forgotten
        del self._pending[pending.fd]
        group = self._by_group[pending.group]
        del group[pending.fd]
        if not group:
            del self._by_group[pending.group]
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(pending.sock)

    def _drop(self, pending: _Pending) -> None:
        self._forget_pending(pending)
        pending.sock.close()

    def _advance(self, pending: _Pending) -> None:
        """Drive one connection as far as its bytes allow."""
        if self._pending.get(pending.fd) is not pending:
            return  # dropped earlier in this round of events
        try:
            problem = self._step(pending)
        except (ssl.SSLWantReadError, BlockingIOError):
            self._watch(pending, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._watch(pending, selectors.EVENT_WRITE)
            return
        except (OSError, EOFError, ValueError) as exc:
            self._failed += 1
            log.debug("data plane: handshake with %s failed: %s", pending.addr, exc)
            self._drop(pending)
            return
        if problem is not None:
            # A line each for the first few; the rest are counted in the
            # minute's report (a client refused in a loop must not fill the log).
            self._refused += 1
            log.log(
                logging.WARNING if self._refused <= _LOUD_REFUSALS else logging.DEBUG,
                "data plane: refused a connection from %s: %s",
                pending.addr,
                problem,
            )
            self._drop(pending)

    def _watch(self, pending: _Pending, events: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.modify(pending.sock, events, pending)

    def _step(self, pending: _Pending) -> str | None:
        """Advance the handshake and preamble; None once handed to its
        session (or still under way: the Want* exceptions), else why not."""
        if not pending.started:
            pending.started = True
            if self._ctx is not None:
                raw = pending.sock
                self._selector.unregister(raw)
                _tune(raw)
                # The TLS wrapper takes over the descriptor.
                pending.sock = self._ctx.wrap_socket(
                    raw, server_side=True, do_handshake_on_connect=False
                )
                self._selector.register(pending.sock, selectors.EVENT_READ, pending)
            else:
                _tune(pending.sock)
        sock = pending.sock
        if isinstance(sock, ssl.SSLSocket) and pending.preamble is None:
            sock.do_handshake()
        if pending.preamble is None:
            pending.preamble = bytearray(_PREAMBLE)
        view = memoryview(pending.preamble)
        while pending.got < _PREAMBLE:
            got = sock.recv_into(view[pending.got :])
            if not got:
                raise EOFError("closed before its preamble")
            pending.got += got
        self._forget_pending(pending)  # authenticated or refused, no longer pending
        return self._admit(pending)

    def _admit(self, pending: _Pending) -> str | None:
        """Hand a connection with a whole preamble to its session; returns
        why it was refused, or None."""
        sock = pending.sock
        assert pending.preamble is not None
        preamble = pending.preamble
        magic, rest = preamble[: len(MAGIC)], preamble[len(MAGIC) :]
        direction, secret = bytes(rest[:1]), bytes(rest[1:])
        if magic != MAGIC or direction not in (UP, DOWN):
            return "not a data-plane preamble"
        with self._lock:
            expected = next(
                (e for e in self._expected if hmac.compare_digest(e.secret, secret)),
                None,
            )
        if expected is None:
            return "unknown or expired session secret"
        if isinstance(sock, ssl.SSLSocket):
            peer_identity = certificate_identity(sock.getpeercert(binary_form=True))
            if not hmac.compare_digest(peer_identity, expected.identity):
                return "its certificate is not the one its session was opened with"
        with expected.cond:
            if expected.cancelled or direction in expected.socks:
                return "its session already has that connection"
            sock.settimeout(None)  # blocking from here on: the session's own
            sock.sendall(_ACK)
            expected.socks[direction] = sock
            expected.cond.notify_all()
        return None

    def _report(self, now: float) -> None:
        if now - self._last_report < _REPORT_EVERY_S:
            return
        if self._evicted or self._timed_out or self._failed or self._refused:
            log.warning(
                "data plane: in the last %.0f s, %d unauthenticated connections "
                "were dropped to make room (at most %d held at once), %d did not "
                "authenticate within %g s, %d failed their handshake, %d were "
                "refused (a wrong preamble, secret or certificate)",
                now - self._last_report,
                self._evicted,
                self.max_pending,
                self._timed_out,
                self._timeout,
                self._failed,
                self._refused,
            )
        self._evicted = self._timed_out = self._failed = self._refused = 0
        self._last_report = now

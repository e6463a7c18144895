"""The parts of the gRPC link shared by its client and server ends.

A :class:`GrpcLink` adapts one bidirectional ``Exchange`` stream to
:class:`LinkCore`: outbound frames go through a small bounded queue that gRPC
drains (the request iterator on a client, the response generator on a
server), inbound frames are read by a dedicated thread. Messages are
serialised by the link itself (see ``frames.tensor_frames``), so gRPC is
registered with an identity serialiser and ``frames.parse_frame`` as the
deserialiser.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Iterable, Iterator

import grpc

from aisyn.net import is_loopback, split_host_port

from ._core import LinkCore
from .base import LinkOptions, PeerHello
from .codec import Encoded
from .data_plane import IDLE, Plane
from .errors import (
    AuthError,
    FrameError,
    FrameTooLargeError,
    HandshakeError,
    LinkError,
    LinkTimeoutError,
    MalformedFrameError,
    PeerAbortedError,
    PeerLostError,
)
from .frames import (
    MAX_MESSAGE_BYTES,
    ChunkData,
    FrameKey,
    Inbound,
    Wire,
    check_hello,
    frame_kind,
    tensor_chunks,
)

log = logging.getLogger(__name__)

SERVICE = "aisyn.link.v1.TensorLink"
METHOD = f"/{SERVICE}/Exchange"
TOKEN_HEADER = "authorization"

_END = b""  # sentinel in the outbound queue; real frames are never empty
#: how long a dropped data plane waits for the reason on the control stream
_REASON_GRACE_S = 2.0
#: the plane thread leaves the data plane to receivers that read it within this
_CALLER_GRACE_S = 0.002
_PLANE_PAUSE_MAX_S = 0.02


def identity(frame: bytes) -> bytes:
    return frame


def _kind(item: Inbound) -> str:
    return "none" if item.frame is None else frame_kind(item.frame)


def _is_error(item: Inbound) -> bool:
    return _kind(item) == "error"


# ------------------------------------------------------------------ addresses


def check_plaintext(
    address: str, insecure: bool, allow_remote: bool, has_tls: bool
) -> None:
    """Enforce: TLS unless insecure=True, and plaintext only on loopback unless
    explicitly allowed (activations and gradients leak training data)."""
    if has_tls and insecure:
        raise ValueError("pass either tls=... or insecure=True, not both")
    if not has_tls and not insecure:
        raise ValueError("TLS material is required; pass insecure=True for plaintext")
    if insecure and not allow_remote:
        host = split_host_port(address)[0]
        if not is_loopback(host):
            raise ValueError(
                f"refusing plaintext on non-loopback address {address!r}: "
                "use mutual TLS, or pass allow_insecure_remote=True"
            )


def grpc_options(opts: LinkOptions, *, server: bool) -> list[tuple[str, int]]:
    keepalive_ms = int(opts.keepalive_s * 1000)
    common = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # Pings detect a silent peer (unplugged cable, frozen host) within
        # keepalive + timeout, even while no data flows.
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", int(opts.keepalive_timeout_s * 1000)),
        # Recent gRPC cores time out the keepalive ping with the generic ping
        # timeout (default 60 s) rather than keepalive_timeout_ms; set both.
        ("grpc.http2.ping_timeout_ms", int(opts.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if server:
        # Accept the client's frequent pings instead of answering GOAWAY
        # "too_many_pings" (the default minimum interval is 5 minutes).
        return common + [
            ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms // 2),
            ("grpc.http2.max_ping_strikes", 0),
        ]
    return common + [
        ("grpc.enable_retries", 0),  # a stream cannot be replayed transparently
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


# --------------------------------------------------------- status <-> errors


def status_for(exc: LinkError) -> grpc.StatusCode:
    if isinstance(exc, AuthError):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(exc, FrameError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, HandshakeError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.ABORTED


def error_for(
    code: grpc.StatusCode | None, details: str | None, peer: str
) -> LinkError:
    """Map a gRPC status received from ``peer`` to the link's exceptions."""
    details = details or "no details"
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(f"{peer} rejected our credentials: {details}")
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return FrameError(f"{peer} rejected the session: {details}")
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return HandshakeError(f"{peer} refused the session: {details}")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return FrameTooLargeError(f"{peer}: {details}")
    if code is grpc.StatusCode.ABORTED:  # what status_for() gives Link.abort()
        return PeerAbortedError(f"{peer} aborted the session: {details}")
    name = code.name if code is not None else "stream error"
    return PeerLostError(f"lost {peer}: {name}: {details}")


# ----------------------------------------------------------------- the link


class GrpcLink(LinkCore):
    """A link over one gRPC ``Exchange`` stream (client or server end)."""

    #: on a server's link: what its session callback agreed to (``Accept``)
    agreed: object = None
    #: on a client's link: the server's data-plane offer (port, secret)
    _offer: tuple[int, bytes] | None = None
    _inline_small = True

    def __init__(
        self, options: LinkOptions, name: str, peer: PeerHello | None, remote: str
    ) -> None:
        super().__init__(options, name, peer or PeerHello("", 0, ""))
        self._remote = remote
        self._hello_done = peer is not None
        self._out: queue.Queue[bytes] = queue.Queue(maxsize=options.frames_in_flight)
        self._dead = threading.Event()  # set once the stream takes no more frames
        self._reader = threading.Thread(
            target=self._read_loop, name=f"{name}-recv", daemon=True
        )
        self._inbound: Iterable[Inbound] = ()
        # The data plane, once attached (data_plane.py); until then, and
        # without one, frames travel on the gRPC stream.
        self._plane: Plane | None = None
        self._plane_offered = False  # frames on the stream are then a violation
        self._plane_over = False  # nothing more will be read from it
        self._reading = False  # a thread holds the reader's role (under _cond)
        self._want_read = 0  # receivers waiting to take it
        self._caller_read_at = 0.0  # when a receiver last read (monotonic)
        self._plane_waiting = False  # the plane thread waits for a frame
        self._plane_cond = threading.Condition(self._lock)  # where it parks
        self._plane_reader = threading.Thread(
            target=self._plane_loop, name=f"{name}-plane", daemon=True
        )

    def _attach(self, plane: Plane) -> None:
        self._plane = plane
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._plane_reader.start()

    # -- outbound

    def _write(self, frame: bytes | Wire) -> int:
        if self._plane is not None:
            if isinstance(frame, Wire):
                return self._plane.out.write(frame.header, frame.data)
            return self._plane.out.write(frame)
        assert isinstance(frame, bytes)
        # Bounded waits so a sender blocked on a stalled stream notices teardown.
        while not self._dead.is_set():
            try:
                self._out.put(frame, timeout=0.1)
                return len(frame)
            except queue.Full:
                continue
        raise PeerLostError(f"{self._name}: stream closed")

    def _tensor_wire(
        self, key: FrameKey, enc: Encoded, data: ChunkData | None
    ) -> Iterator[bytes | Wire]:
        if self._plane is None:
            return super()._tensor_wire(key, enc, data)
        return tensor_chunks(key, enc, self._opts.chunk_bytes, data)

    def _outgoing(self) -> Iterator[bytes]:
        """Frames for gRPC to write, until the end marker."""
        while (frame := self._out.get()) is not _END:
            yield frame

    def _end_writes(self) -> None:
        self._push_end()

    def _peer_said_bye(self) -> None:
        # Whatever we still had queued has no reader any more.
        self._dead.set()
        self._push_end(drop_queued=True)

    def _push_end(self, last: bytes | None = None, drop_queued: bool = False) -> None:
        """Queue ``last`` (if any) and the end marker; with ``drop_queued``,
        unsent frames are discarded first (the session is being abandoned)."""
        if drop_queued:
            self._drain()
        for item in (last, _END) if last is not None else (_END,):
            while True:
                try:
                    self._out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    if self._dead.is_set():
                        self._drain()  # gRPC may have stopped consuming

    def _drain(self) -> None:
        try:
            while True:
                self._out.get_nowait()
        except queue.Empty:
            pass

    # -- inbound

    def _read_loop(self) -> None:
        try:
            for item in self._inbound:
                if not self._hello_done:
                    self._on_hello(item)
                elif self._plane_offered and not _is_error(item):
                    raise MalformedFrameError(
                        "a frame came on the control stream: this session's "
                        "frames travel on its data plane"
                    )
                else:
                    self._on_frame(item)
        except (FrameError, HandshakeError) as exc:
            self._fail(exc, notify_peer=True)
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call):  # the peer's status, with its reason
                err = error_for(exc.code(), exc.details(), self._remote)
            else:  # the call died under us (on a server: cancelled or dropped)
                err = PeerLostError(self._ended_abruptly())
            self._fail(err, notify_peer=False)
        except Exception as exc:  # a bug here must not leave recv() hanging
            log.exception("%s: receiver failed", self._name)
            self._fail(LinkError(f"receiver failed: {exc!r}"), notify_peer=False)
        else:
            if not self._ended() and self._plane_reader.is_alive():
                # The goodbye travels on the data plane, which may be behind.
                self._plane_reader.join(self._opts.close_timeout_s)
            if not self._ended():
                self._fail(PeerLostError(self._ended_abruptly()), notify_peer=False)
        finally:
            self._dead.set()

    # Reading the data plane. Frames are read one at a time by whoever holds
    # the reader's role (_reading, under _cond): a receiver waiting in recv()
    # takes it and reads its frames itself; the plane thread reads whenever
    # no receiver has for a moment. A frame handed from a reading thread to a
    # waiting one costs two thread wake-ups (the waiter, then the interpreter
    # lock) -- on a small virtual machine as much as a round trip on the wire
    # -- which reading in the waiting thread saves. So that the plane thread
    # neither wakes on a receiver's frames nor is woken when they are
    # delivered, it parks on a condition of its own while receivers are
    # active (looking again after 2 to 20 ms) and only then waits for a
    # frame's start; a receiver that finds it waiting pokes it (_wake).

    def _plane_loop(self) -> None:
        """The data plane's background reader."""
        assert self._plane is not None
        inbound = self._plane.inbound
        while True:
            with self._cond:
                # Looks again after 2 ms, then ever less often while receivers
                # keep reading (up to 50 times a second): a receiver waiting
                # long for its frame must not keep this thread spinning.
                pause = _CALLER_GRACE_S
                while not self._plane_over:
                    busy = self._reading or self._want_read
                    quiet = time.monotonic() - self._caller_read_at
                    if not busy and quiet >= _CALLER_GRACE_S:
                        break
                    self._plane_cond.wait(pause)
                    pause = min(2 * pause, _PLANE_PAUSE_MAX_S)
                if self._plane_over:
                    return
                self._plane_waiting = True
            ready = inbound.wait_readable(None, self._wake_r)
            with self._cond:
                self._plane_waiting = False
                if not ready or self._reading or self._want_read:
                    continue  # poked: a receiver is taking the role
                if self._plane_over:
                    return
                self._reading = True
            try:
                inbound.set_timeout(None)
                self._read_frame()
            finally:
                self._release_reader()

    def _wait_for_frames(self, timeout: float | None) -> None:
        if self._plane is None or self._plane_over:
            self._cond.wait(timeout)
            return
        if self._reading:  # mid-frame, or another receiver: it delivers
            self._want_read += 1
            try:
                self._cond.wait(timeout)
            finally:
                self._want_read -= 1
            return
        self._reading = True
        if self._plane_waiting:  # the plane thread: step aside
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")
        self._cond.release()
        try:
            inbound = self._plane.inbound
            if inbound.wait_readable(timeout, None):
                # A peer alive but stuck mid-frame must not hold this caller
                # past its own timeout (the read then fails the session);
                # whole seconds, so that it rarely changes (system calls).
                inbound.set_timeout(
                    None if timeout is None else float(math.ceil(max(timeout, 1.0)))
                )
                self._read_frame()
        finally:
            self._cond.acquire()
            self._reading = False
            self._caller_read_at = time.monotonic()
            self._cond.notify_all()  # receivers waiting for the role

    def _release_reader(self) -> None:
        with self._cond:
            self._reading = False
            self._cond.notify_all()

    def _read_frame(self) -> None:
        """Read and handle one frame (the reader's role held); a failure ends
        the link, and the end of the data plane stops all reading."""
        assert self._plane is not None
        try:
            item = self._plane.inbound.read()
            if item is IDLE:
                return
            if item is None:
                self._plane_ended()
                self._plane_lost()
                return
            self._on_frame(item)
            if _kind(item) == "bye":
                self._plane_ended()  # nothing may follow; the peer closes its end
        except (FrameError, HandshakeError) as exc:
            self._plane_ended()
            self._fail(exc, notify_peer=True)
        except LinkTimeoutError as exc:
            self._plane_ended()
            self._fail(exc, notify_peer=True)
        except PeerLostError:
            self._plane_ended()
            self._plane_lost()
        except Exception as exc:  # a bug here must not leave recv() hanging
            self._plane_ended()
            log.exception("%s: data-plane receiver failed", self._name)
            self._fail(LinkError(f"receiver failed: {exc!r}"), notify_peer=False)

    def _plane_ended(self) -> None:
        with self._cond:
            self._plane_over = True
            self._cond.notify_all()
            self._plane_cond.notify_all()

    def _ended(self) -> bool:
        """Closed here, or the peer said goodbye: an end of stream is due."""
        with self._cond:
            return self._closing or self._peer_gone is not None

    def _plane_lost(self) -> None:
        if self._ended() or self._torn_down.is_set():
            return
        # A peer ending the session abnormally says why on the control stream,
        # which may arrive a moment after its data-plane connection dropped.
        self._torn_down.wait(_REASON_GRACE_S)
        self._fail(PeerLostError(self._ended_abruptly()), notify_peer=False)

    def _close_plane(self) -> None:
        if self._plane is not None:
            self._shutdown_plane()
            if self._plane_reader.is_alive():
                self._plane_reader.join(self._opts.close_timeout_s)
            self._plane.out.close()
            self._plane.inbound.close()
            self._wake_r.close()
            self._wake_w.close()

    def _shutdown_plane(self) -> None:
        """Unblock the data plane's reader and writer (teardown)."""
        if self._plane is not None:
            self._plane_ended()
            self._plane.out.shutdown()
            self._plane.inbound.shutdown()
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

    def _ended_abruptly(self) -> str:
        return f"{self._remote} ended the session without saying goodbye"

    def _on_hello(self, item: Inbound) -> None:
        self._received += item.nbytes
        if item.frame is None:
            raise MalformedFrameError(item.error or "undecodable frame")
        peer = check_hello(item.frame)
        hello = item.frame.hello
        with self._cond:
            if hello.data_port:  # the server offers its data plane
                self._offer = (hello.data_port, hello.data_secret)
                self._plane_offered = True
            self.peer = peer
            self._hello_done = True
            self._cond.notify_all()

    def _wait_hello(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._hello_done or self._error, timeout)
            if self._hello_done:
                # The session is open even if it already failed (a server may
                # abort right after its HELLO): the first recv() reports that.
                return
            if self._error is not None:
                self._check_usable()
            raise PeerLostError(f"no HELLO from {self._remote} within {timeout:g} s")

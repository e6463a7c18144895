"""A bulk data plane beside the gRPC control stream.

gRPC costs about a millisecond per message and tops out near half of what one
TLS socket moves on this kind of host (``bench/link_throughput.py``). A server
started with ``data_listen`` therefore offers each session a data plane in its
HELLO: a port and a one-time secret, which only the client that passed the
token and mutual TLS on the gRPC stream can read. The client dials that port
twice, once per direction, and from then on every frame of the session --
tensors, scalars, the goodbye -- travels on those two connections, in order.
The gRPC stream stays open as the control stream: it carries keepalive pings
and the reason when a side ends the session abnormally.

Why two connections, one per direction: each TLS object is then driven by one
thread only (OpenSSL does not allow one SSL object to be read and written from
two threads at once), and each direction gets its own TCP window, which is
what fills a long fat link.

Who may attach. The connection must present the same client certificate as
the gRPC stream (its SHA-256 is compared with the session's identity) and the
session's secret (compared in constant time), within the handshake timeout;
anything else is closed with nothing read beyond the fixed-size preamble. One
connection per direction is accepted per session. The server's side of that,
and what it holds for connections that never authenticate, is
``data_listener.py``; this module is the framing and the client's dial.

Framing on the wire, after the preamble: an 8-byte header (length of a
serialised ``Frame`` without tensor data, length of the raw data that follows
it), then those two parts. A TENSOR frame's header is validated by the link's
:class:`~aisyn.link.assembly.TensorAssembler` -- sizes, order, memory budget --
before its data is read, and the data is then received straight into the
destination tensor (no intermediate buffer, no per-frame Python objects
beyond the header); the sender writes the data straight from the tensor.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import select
import socket
import ssl
import struct
import tempfile
from collections.abc import Sequence
from typing import NamedTuple

from google.protobuf.message import DecodeError

from aisyn.net import split_host_port

from .base import MAX_CHUNK_BYTES
from .certs import TlsConfig
from .errors import (
    FrameTooLargeError,
    HandshakeError,
    LinkTimeoutError,
    MalformedFrameError,
    PeerLostError,
)
from .frames import DATA_SECRET_BYTES as SECRET_BYTES
from .frames import Deferred, Inbound
from .proto import tensor_link_pb2 as pb

log = logging.getLogger(__name__)

MAGIC = b"AISYN-DP1"
UP, DOWN = b"u", b"d"  # client -> server, server -> client
_PREAMBLE = len(MAGIC) + 1 + SECRET_BYTES
_ACK = b"\x01"
_HEADER = struct.Struct("!II")
#: a frame's protobuf part: a tensor header (tag, dtype, shape) or a scalar,
#: error or goodbye -- never more than a few hundred bytes from an honest peer
MAX_HEADER_BYTES = 64 * 1024
#: frames up to this size are joined into one write (a copy is cheaper than
#: a second TLS record and system call)
_COALESCE_BYTES = 64 * 1024
#: what one receive call may read ahead; must hold the largest header
_READ_BUFFER = MAX_HEADER_BYTES + 8 + 64 * 1024


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def certificate_identity(der: bytes) -> str:
    """The link's name for a peer certificate (as the gRPC server computes it)."""
    return "x509-sha256:" + hashlib.sha256(der).hexdigest()


def tls_context(tls: TlsConfig, *, server: bool) -> ssl.SSLContext:
    """A Python ``ssl`` context of the same mutual TLS as the gRPC stream:
    the same certificate, key and CA; the server requires a client
    certificate. TLS 1.3 only (what the gRPC stream negotiates)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(cadata=tls.root_ca.decode("ascii"))
    ctx.verify_mode = ssl.CERT_REQUIRED
    # ssl loads a key only from a file: a private folder, removed at once.
    with tempfile.TemporaryDirectory(prefix="aisyn-tls-") as tmp:
        cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        for path, data in ((cert, tls.cert_chain), (key, tls.private_key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert, key)
    return ctx


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        got = sock.recv_into(view)
        if not got:
            raise EOFError
        view = view[got:]


# ------------------------------------------------------------------ framing


#: what ``FrameSocket.read`` returns when no frame began before its timeout
IDLE = Inbound(None, 0, "no frame yet")


class FrameSocket:
    """One direction of the data plane: frames out, or frames in."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self._sock = sock
        self._name = name
        self._buf = bytearray(_READ_BUFFER)
        self._view = memoryview(self._buf)
        self._pos = self._end = 0  # unread bytes: _buf[_pos:_end]
        self._timeout: float | None = sock.gettimeout()
        self._closed = False

    def write(self, header: bytes, data: Sequence[memoryview | bytes] = ()) -> int:
        """Send one frame; returns the bytes written. Raises PeerLostError."""
        size = sum(len(d) for d in data)
        head = _HEADER.pack(len(header), size) + header
        try:
            if size <= _COALESCE_BYTES:  # one TLS record, one system call
                self._sock.sendall(b"".join([head, *data]))
            else:
                self._sock.sendall(head)
                for part in data:
                    self._sock.sendall(part)
        except (OSError, ValueError) as exc:  # ValueError: closed under us
            raise PeerLostError(f"{self._name}: data plane lost: {exc}") from None
        return _HEADER.size + len(header) + size

    def read(self) -> Inbound | None:
        """The next frame, its data still to be read (``Inbound.data``); None
        at a clean end of stream between frames; ``IDLE`` if the read timed
        out before a frame began (TLS records that carry no data can make a
        socket readable with no frame behind them). Raises FrameError for a bad
        header, PeerLostError for a connection lost mid-frame."""
        if not self._buffered():
            try:
                if not self._refill():
                    return None
            except LinkTimeoutError:  # not one byte of a frame yet: nothing lost
                return IDLE
        head = self._take(_HEADER.size)
        header_len, data_len = _HEADER.unpack(head)
        if header_len > MAX_HEADER_BYTES:
            raise FrameTooLargeError(
                f"frame header of {header_len} bytes exceeds {MAX_HEADER_BYTES}"
            )
        if data_len > MAX_CHUNK_BYTES:
            raise FrameTooLargeError(
                f"chunk of {data_len} bytes exceeds the {MAX_CHUNK_BYTES} limit"
            )
        frame = pb.Frame()
        try:
            frame.ParseFromString(self._take(header_len))
        except DecodeError as exc:
            raise MalformedFrameError(
                f"undecodable frame header of {header_len} bytes: {exc}"
            ) from None
        kind = frame.WhichOneof("kind")
        if kind == "tensor" and frame.tensor.data:
            raise MalformedFrameError("a TENSOR header must not carry data itself")
        if kind != "tensor" and data_len:
            raise MalformedFrameError(f"a {str(kind).upper()} frame carries no data")
        nbytes = _HEADER.size + header_len + data_len
        return Inbound(frame, nbytes, data=Deferred(data_len, self._fill))

    # Reads go through a small buffer, so a small frame (its header and data)
    # costs one receive call rather than three; bulk data already buffered is
    # copied out, the rest is received straight into the destination.

    def _buffered(self) -> int:
        return self._end - self._pos

    def _refill(self) -> bool:
        """Receive whatever is available (at least one byte); False at EOF."""
        if self._pos == self._end:
            self._pos = self._end = 0
        elif self._end == len(self._buf):  # keep the unread tail, at the front
            tail = self._buf[self._pos : self._end]
            self._buf[: len(tail)] = tail
            self._pos, self._end = 0, len(tail)
        try:
            got = self._sock.recv_into(self._view[self._end :])
        except TimeoutError:
            raise self._stalled() from None
        except OSError as exc:
            raise PeerLostError(f"{self._name}: data plane lost: {exc}") from None
        self._end += got
        return got > 0

    def _take(self, n: int) -> bytes:
        """The next ``n`` bytes (n at most the buffer's size)."""
        while self._buffered() < n:
            if not self._refill():
                raise PeerLostError(f"{self._name}: data plane cut mid-frame")
        out = bytes(self._view[self._pos : self._pos + n])
        self._pos += n
        return out

    def _stalled(self) -> LinkTimeoutError:
        timeout = self._sock.gettimeout()
        return LinkTimeoutError(
            f"{self._name}: the peer sent part of a frame, then nothing for "
            f"{timeout:g} s"
        )

    def _fill(self, view: memoryview) -> None:
        have = min(self._buffered(), len(view))
        view[:have] = self._view[self._pos : self._pos + have]
        self._pos += have
        try:
            _recv_exact(self._sock, view[have:])
        except EOFError:
            raise PeerLostError(f"{self._name}: data plane cut mid-frame") from None
        except TimeoutError:
            raise self._stalled() from None
        except OSError as exc:
            raise PeerLostError(f"{self._name}: data plane lost: {exc}") from None

    def wait_readable(self, timeout: float | None, wake: socket.socket | None) -> bool:
        """Wait until a frame has begun to arrive (True) or ``wake`` is poked
        or ``timeout`` passes (False). Called between frames only."""
        if self._buffered() or getattr(self._sock, "pending", lambda: 0)():
            return True
        # poll, not select: under a flood of connections this socket's
        # descriptor may be above select's limit of 1024.
        try:
            poller = select.poll()
            mine = self._sock.fileno()
            poller.register(mine, select.POLLIN)
            if wake is not None:
                poller.register(wake.fileno(), select.POLLIN)
            ms = None if timeout is None else max(0, int(timeout * 1000))
            ready = {fd for fd, _ in poller.poll(ms)}
        except (OSError, ValueError):  # closed under us: the read will say so
            return True
        if wake is not None and wake.fileno() in ready:
            with contextlib.suppress(OSError):
                wake.recv(4096)
        return mine in ready

    def set_timeout(self, timeout: float | None) -> None:
        """How long one receive call may wait (None: forever)."""
        if timeout != self._timeout:  # each change costs system calls
            self._timeout = timeout
            with contextlib.suppress(OSError):
                self._sock.settimeout(timeout)

    def shutdown(self) -> None:
        """Unblock any thread reading or writing (at the socket, not TLS level:
        another thread may be inside the TLS object)."""
        try:
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.shutdown()
            self._sock.close()


class Plane(NamedTuple):
    """A session's two connections, from this side's point of view."""

    out: FrameSocket
    inbound: FrameSocket


# -------------------------------------------------------------------- client


def dial(
    address: str,
    secret: bytes,
    tls: TlsConfig | None,
    server_name: str | None,
    timeout: float,
) -> tuple[socket.socket, socket.socket]:
    """The client's two data-plane connections to ``address`` (up, down)."""
    host, port = split_host_port(address)
    ctx = tls_context(tls, server=False) if tls is not None else None
    socks: list[socket.socket] = []
    try:
        for direction in (UP, DOWN):
            try:
                raw = socket.create_connection((host, port), timeout=timeout)
            except OSError as exc:
                raise PeerLostError(
                    f"cannot reach the data plane at {address}: {exc}"
                ) from None
            socks.append(raw)
            _tune(raw)
            sock: socket.socket = raw
            if ctx is not None:
                try:
                    sock = ctx.wrap_socket(raw, server_hostname=server_name or host)
                except (ssl.SSLError, OSError) as exc:
                    raise HandshakeError(
                        f"TLS with the data plane at {address} failed: {exc}"
                    ) from None
                socks[-1] = sock
            ack = bytearray(1)
            try:
                sock.sendall(MAGIC + direction + secret)
                _recv_exact(sock, memoryview(ack))
            except TimeoutError:
                raise LinkTimeoutError(
                    f"the data plane at {address} did not answer in {timeout:g} s"
                ) from None
            except (OSError, EOFError):
                raise HandshakeError(
                    f"the data plane at {address} refused this connection (wrong "
                    "certificate, secret or port)"
                ) from None
            sock.settimeout(None)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks[0], socks[1]

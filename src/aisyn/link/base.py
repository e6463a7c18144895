"""The link interface shared by the in-memory and gRPC implementations."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import torch

from .codec import CODECS

__all__ = ["MAX_CHUNK_BYTES", "Link", "LinkOptions", "PeerHello"]

#: Largest data slice in one frame. gRPC's default message limit is 4 MiB and
#: every hop (proxies, load balancers) is configured around it; staying under it
#: also bounds the memory a single frame can pin on either side.
MAX_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class LinkOptions:
    """Tuning and limits of one link endpoint (both sides may differ)."""

    #: default codec for :meth:`Link.send` ("none", "fp16", "bf16", "int8")
    codec: str = "none"
    #: bytes of tensor data per frame, at most MAX_CHUNK_BYTES
    chunk_bytes: int = MAX_CHUNK_BYTES
    #: largest tensor accepted from the peer (decoded size); bigger ones end the session
    max_tensor_bytes: int = 1 << 30
    #: received-but-unconsumed data buffered before the peer is cut off
    max_pending_bytes: int = 4 << 30
    #: buffers of received tensors the application has dropped, kept for the
    #: next tensors of the same size (``assembly.ReceivePool``); 0 turns it off
    recv_pool_bytes: int = 1 << 30
    #: serialised frames queued ahead of the transport (lets encoding overlap I/O)
    frames_in_flight: int = 4
    #: default timeout of recv()/recv_scalar(); None waits until data or peer loss
    recv_timeout_s: float | None = None
    #: frames of a step the receiver left without reading them are dropped with
    #: a warning (True), or end the session as a protocol error (False) -- for
    #: protocols that read every frame, so that a peer answering under the
    #: wrong step fails the session at once instead of leaving a receiver waiting
    drop_unread: bool = True
    #: gRPC keepalive ping period and ack timeout: a silent peer is declared
    #: lost after roughly their sum. On a slow, saturated link a ping can queue
    #: behind megabytes of data: raise the timeout above (socket buffers +
    #: chunk size) / bandwidth, e.g. 10 s at 10 Mbit/s.
    keepalive_s: float = 1.0
    keepalive_timeout_s: float = 2.0
    #: how long connect()/the server wait for the HELLO exchange
    handshake_timeout_s: float = 10.0
    #: how long close() waits to flush queued sends and for the peer's goodbye
    close_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(
                f"unknown codec {self.codec!r} (known: {', '.join(CODECS)})"
            )
        if not 1 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}]")
        if self.frames_in_flight < 1:
            raise ValueError("frames_in_flight must be >= 1")
        if self.recv_pool_bytes < 0:
            raise ValueError("recv_pool_bytes must be >= 0")
        for name in ("max_tensor_bytes", "max_pending_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        for name in ("keepalive_s", "keepalive_timeout_s", "handshake_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.recv_timeout_s is not None and not self.recv_timeout_s > 0:
            raise ValueError("recv_timeout_s must be positive (None: no timeout)")


@dataclass(frozen=True, slots=True)
class PeerHello:
    """What the peer announced when the session opened."""

    role: str
    protocol_version: int
    #: opaque string the parties use to agree on config, cut layer, resume step
    session: str
    #: who the peer is, as the transport vouches for it (not what it claims):
    #: on a gRPC server ``x509-sha256:<hex>`` of the client's certificate
    #: under mutual TLS, else ``token-sha256:<hex>`` of the token it presented;
    #: ``in-process`` on a memory link; empty where nothing vouches for it
    identity: str = ""
    #: on a gRPC server, ``token-sha256:<hex>`` of the token the peer
    #: presented (a server may accept several: one per tenant)
    token_identity: str = ""
    #: on a gRPC server under mutual TLS, the client certificate's subject
    #: (RFC 4514, e.g. ``CN=hospital,O=Example``); empty otherwise
    subject: str = ""


class Link(ABC):
    """A bidirectional channel for cut-layer tensors and scalars between two parties.

    Frames are addressed by key: (tag, step, micro) for tensors, (tag, step)
    for scalars. ``recv`` matches by key, so several micro-batches may be in
    flight in any order within a step. The protocol requires steps to be
    non-decreasing on each direction of the link and keys to be unique;
    violations end the session with a :class:`~aisyn.link.errors.FrameError`.

    Any failure (bad frame, lost peer, local close) is sticky: every later
    call raises it. All methods are thread-safe.
    """

    #: the peer's HELLO (role, protocol version, session string)
    peer: PeerHello

    @abstractmethod
    def send(
        self,
        tag: str,
        tensor: torch.Tensor,
        *,
        step: int,
        micro: int = 0,
        codec: str | None = None,
    ) -> None:
        """Queue ``tensor`` for the peer and return immediately.

        The tensor is detached (autograd graphs never cross the link) and
        neither copied nor modified here; a background thread encodes and
        transmits it, overlapping communication with compute. Do not modify it
        in place before :meth:`flush` returns (the contract of
        ``torch.distributed.isend``). A modification that finished before the
        sender read the tensor's last bytes ends the session, with the reason
        told to both sides, rather than send torn data; one that races that
        read itself can go unseen, since torch bumps a tensor's version only
        when an in-place op is done. ``codec`` overrides the
        link's default for this tensor. Raises ValueError for a bad key/dtype.
        """

    @abstractmethod
    def recv(
        self,
        tag: str,
        *,
        step: int,
        micro: int = 0,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        timeout: float | None = None,
    ) -> torch.Tensor:
        """Block until the tensor with this key arrives and return it.

        The tensor is a fresh CPU tensor owned by the caller, except on an
        in-memory link with codec "none", which hands over the sender's
        (detached) tensor itself.

        If ``shape``/``dtype`` are given and differ, raises
        FrameMismatchError and ends the session. Raises LinkTimeoutError after
        ``timeout`` seconds (default: ``LinkOptions.recv_timeout_s``) and
        PeerLostError if the peer goes away first.
        """

    @abstractmethod
    def send_scalar(self, tag: str, value: float, *, step: int) -> None:
        """Queue one float (e.g. a local grad-norm) for the peer; non-blocking."""

    @abstractmethod
    def recv_scalar(
        self, tag: str, *, step: int, timeout: float | None = None
    ) -> float:
        """Block until the scalar with this key arrives and return it."""

    @abstractmethod
    def flush(self, timeout: float | None = None) -> None:
        """Block until everything queued by send*() was handed to the transport."""

    @abstractmethod
    def close(self) -> None:
        """Flush queued sends, say goodbye and release resources. Idempotent."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """End the session now because of ``reason`` (one line), telling the peer.

        Queued sends are dropped. The peer's pending and later calls raise
        :class:`~aisyn.link.errors.PeerAbortedError` carrying ``reason`` (a gRPC
        server receives a client's reason as a FrameError, like any rejection);
        this side's raise LinkClosedError. A no-op if the link has already
        failed or been closed; call close() afterwards to release resources.
        """

    @property
    @abstractmethod
    def bytes_sent(self) -> int:
        """Wire bytes sent so far (serialised frames, as a network would count)."""

    @property
    @abstractmethod
    def bytes_received(self) -> int:
        """Wire bytes received so far."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Service:
    """A server (:class:`GrpcLinkServer`, :class:`ShapedProxy`) that ``with``
    starts -- its ``start()`` returns it -- and stops."""

    def __enter__(self) -> Self:
        return self.start()  # type: ignore[attr-defined]

    def __exit__(self, *exc_info: object) -> None:
        self.stop()  # type: ignore[attr-defined]

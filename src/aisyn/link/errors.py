"""Exceptions raised by links.

Every failure a training loop may want to tell apart has its own class, all
under :class:`LinkError`, and every message is one line that names the frame
(tag/step/micro) or the peer involved, so a log line is enough to act on.
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "CertificateError",
    "FrameError",
    "FrameMismatchError",
    "FrameOrderError",
    "FrameTooLargeError",
    "HandshakeError",
    "LinkClosedError",
    "LinkError",
    "LinkTimeoutError",
    "MalformedFrameError",
    "PeerAbortedError",
    "PeerClosedError",
    "PeerLostError",
    "SessionAbortedError",
]


class LinkError(Exception):
    """Base class of all link failures."""


class FrameError(LinkError):
    """A frame broke the protocol; the session it arrived on is over."""


class MalformedFrameError(FrameError):
    """Undecodable, truncated or internally inconsistent frame."""


class FrameTooLargeError(FrameError):
    """A frame or the data buffered for the receiver exceeds a configured limit."""


class FrameOrderError(FrameError):
    """Step went backwards, duplicate key, or chunks out of order."""


class FrameMismatchError(FrameError):
    """The tensor received does not have the shape/dtype the receiver expected."""


class AuthError(LinkError):
    """The peer's credentials (token or certificate) were rejected."""


class CertificateError(AuthError):
    """TLS cannot work with these certificates: the server's is not for the
    address dialled (``kind`` "name"), not signed by our CA ("untrusted"),
    expired ("expired"), or the server refused ours ("refused"). Retrying
    cannot help. ``hosts``: what the server's certificate is valid for (where
    known); ``dialled``, ``port``: the name and port that were dialled."""

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        hosts: list[str] | None = None,
        dialled: str = "",
        port: int = 0,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.hosts = list(hosts or [])
        self.dialled = dialled
        self.port = port


class HandshakeError(LinkError):
    """The peers disagree on protocol version or the session was refused."""


class PeerLostError(LinkError):
    """The peer went away: connection lost, keepalive timed out or it said BYE."""


class PeerClosedError(PeerLostError):
    """The peer said goodbye (BYE): it closed the session on purpose, so
    between rounds this is a normal end, not a failure."""


class PeerAbortedError(PeerLostError):
    """The peer ended the session because of an error on its side
    (:meth:`~aisyn.link.Link.abort`); the message carries its one-line reason."""


class LinkTimeoutError(LinkError, TimeoutError):
    """A receive or handshake did not complete within its timeout."""


class LinkClosedError(LinkError):
    """The link was closed locally."""


class SessionAbortedError(LinkClosedError):
    """This side ended the session with :meth:`~aisyn.link.Link.abort`; the
    message is the reason it gave (and the peer received)."""

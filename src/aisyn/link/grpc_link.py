"""The link over gRPC, the data party's side: :func:`connect` dials a
compute party served by :class:`~aisyn.link.grpc_server.GrpcLinkServer`.

One session is one bidirectional ``Exchange`` stream. A busy server answers
UNAVAILABLE "busy; queued at position N", and :func:`connect` retries until
its timeout, keeping its place (callers are admitted in order of arrival by
identity, see ``admission.py``).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator

import grpc

from aisyn.net import join_host_port, split_host_port

from . import data_plane, tls_check
from ._grpc_transport import (
    METHOD,
    TOKEN_HEADER,
    GrpcLink,
    check_plaintext,
    grpc_options,
    identity,
)
from .base import LinkOptions
from .certs import TlsConfig
from .data_plane import FrameSocket, Plane
from .errors import (
    LinkError,
    PeerAbortedError,
    PeerLostError,
)
from .frames import error_frame, hello_frame, parse_frame

__all__ = ["GrpcLink", "connect"]

log = logging.getLogger(__name__)


def check_token(token: str) -> None:
    # It travels as an HTTP/2 header value: printable ASCII only.
    if not token or not (token.isascii() and token.isprintable()):
        raise ValueError("token must be a non-empty printable ASCII string")


_QUEUED = re.compile(r"queued at position (\d+)")


class _ClientLink(GrpcLink):
    def __init__(
        self,
        channel: grpc.Channel,
        target: str,
        token: str,
        hello: bytes,
        options: LinkOptions,
        name: str,
    ) -> None:
        super().__init__(options, name, None, target)
        self._fail_level = logging.DEBUG  # until open: connect() reports
        self._channel = channel
        self._requests_done = threading.Event()
        self._call_done = threading.Event()
        self._aborter: threading.Thread | None = None
        exchange = channel.stream_stream(
            METHOD, request_serializer=identity, response_deserializer=parse_frame
        )
        # wait_for_ready=False: fail fast while the server is down; connect()
        # retries, which also surfaces TLS/auth errors instead of hanging.
        self._call = exchange(
            self._requests(hello),
            metadata=((TOKEN_HEADER, f"Bearer {token}"),),
            wait_for_ready=False,
        )
        self._call.add_done_callback(lambda _call: self._call_done.set())
        self._inbound = self._call
        self._sent += len(hello)
        self._reader.start()
        self._start()

    def _requests(self, hello: bytes) -> Iterator[bytes]:
        try:
            yield hello
            yield from self._outgoing()
        finally:
            self._requests_done.set()

    def _teardown(self, exc: LinkError, notify_peer: bool) -> None:
        self._dead.set()
        self._shutdown_plane()
        if notify_peer:
            self._push_end(error_frame(str(exc)), drop_queued=True)
            self._aborter = threading.Thread(
                target=self._cancel_later, name=f"{self._name}-abort", daemon=True
            )
            self._aborter.start()
        else:
            self._push_end(drop_queued=True)
            self._call.cancel()

    def _cancel_later(self) -> None:
        # Cancelling at once could discard the ERROR frame: a server told of the
        # cancel before it reads the frame reports a bare disconnect. Give gRPC
        # a moment to write the frame and the server a moment to end the call
        # itself. (Not the reader thread: it is the one that failed, and it
        # stops reading as soon as it has queued the frame.)
        if self._requests_done.wait(1.0):
            self._call_done.wait(2.0)
        self._call.cancel()

    def _shutdown(self, graceful: bool, timeout: float) -> None:
        if graceful:  # BYE is out; the server ends the call when it reads it
            self._reader.join(timeout)
        if self._aborter is not None:  # let the ERROR frame reach the server
            self._aborter.join(timeout)
        self._discard(timeout)
        self._close_plane()
        self._channel.close()

    def _open_plane(self, address: str, tls: TlsConfig | None, timeout: float) -> None:
        """Dial the data plane the server offered and move the session onto it."""
        assert self._offer is not None
        server_name = tls.server_name if tls is not None else None
        up, down = data_plane.dial(address, self._offer[1], tls, server_name, timeout)
        self._attach(Plane(FrameSocket(up, self._name), FrameSocket(down, self._name)))

    def _discard(self, timeout: float = 2.0) -> None:
        """Abandon this call (but not the channel, which connect() may reuse)."""
        self._dead.set()
        self._push_end(drop_queued=True)
        self._call.cancel()
        self._jobs.put(None)
        self._reader.join(timeout)


def connect(
    peer: str,
    *,
    token: str,
    tls: TlsConfig | None = None,
    insecure: bool = False,
    allow_insecure_remote: bool = False,
    role: str = "A",
    session: str = "",
    options: LinkOptions | None = None,
    timeout: float | None = None,
    data_peer: str | None = None,
) -> GrpcLink:
    """Open a session with the server at ``peer`` ("host:port") and return the link.

    A server that offers a data plane is dialled on ``peer``'s host at the
    port it names, or at ``data_peer`` ("host:port") where that differs (a
    proxy or NAT in between).

    Retries while the server is unreachable or busy, for up to ``timeout``
    seconds (default ``options.handshake_timeout_s``), logging each kind of
    failure once; a busy server queues this identity, and its place is
    logged whenever it changes. Raises AuthError for a rejected token,
    CertificateError (an AuthError) at once for certificates that cannot
    work (not for this address, another CA, expired: see ``tls_check.py``),
    HandshakeError for a refused HELLO, PeerLostError when no session could
    be opened in time, ValueError for an insecure non-loopback address.
    """
    opts = options or LinkOptions()
    check_plaintext(peer, insecure, allow_insecure_remote, tls is not None)
    check_token(token)
    hello = hello_frame(role, session)
    if tls is not None:
        tls_check.check_own_certificate(tls)
    channel_options = grpc_options(opts, server=False)
    if tls is not None:
        creds = grpc.ssl_channel_credentials(
            root_certificates=tls.root_ca,
            private_key=tls.private_key,
            certificate_chain=tls.cert_chain,
        )
        if tls.server_name:
            channel_options.append(("grpc.ssl_target_name_override", tls.server_name))
        channel = grpc.secure_channel(peer, creds, options=channel_options)
    else:
        channel = grpc.insecure_channel(peer, options=channel_options)

    timeout = opts.handshake_timeout_s if timeout is None else timeout
    deadline = time.monotonic() + timeout
    delay = 0.05
    name = f"link[{role}->{peer}]"
    place = None  # our place in the server's queue, once told
    seen: set[str] = set()  # the kinds of failure already reported
    while True:
        link = _ClientLink(channel, peer, token, hello, opts, name)
        try:
            link._wait_hello(max(0.0, deadline - time.monotonic()))
        except PeerAbortedError:  # the server answered: dialling again won't help
            link._discard()
            channel.close()
            raise
        except PeerLostError as exc:  # not up yet, busy, or unreachable
            link._discard()
            queued = _QUEUED.search(str(exc))
            if queued and queued.group(1) != place:
                place = queued.group(1)
                log.info("%s: the server is busy; queued at position %s", name, place)
            elif not queued and str(exc) not in seen:
                seen.add(str(exc))
                permanent = tls_check.permanent_failure(
                    peer, tls, deadline - time.monotonic()
                )
                if permanent is not None:
                    channel.close()
                    raise permanent from None
                log.warning(
                    "%s: no session yet (%s); retrying for up to %g s",
                    name,
                    exc,
                    timeout,
                )
            if time.monotonic() + delay >= deadline:
                channel.close()
                raise PeerLostError(
                    f"could not open a session with {peer} within {timeout:g} s: {exc}"
                ) from None
            time.sleep(delay)
            delay = min(2 * delay, 1.0)
            continue
        except BaseException:
            link._discard()
            channel.close()
            raise
        break
    link._fail_level = logging.WARNING  # open: its failures are news again
    if link._offer is not None:
        address = data_peer or join_host_port(split_host_port(peer)[0], link._offer[0])
        try:
            link._open_plane(address, tls, max(1.0, deadline - time.monotonic()))
        except BaseException:
            link._discard()
            channel.close()
            raise
        log.info("%s: data plane open to %s", name, address)
    log.info("%s: session open (peer role %r)", name, link.peer.role)
    return link

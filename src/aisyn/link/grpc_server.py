"""The link over gRPC, the compute party's side: :class:`GrpcLinkServer`.

One session is one bidirectional ``Exchange`` stream. The server accepts one
session at a time -- from its HELLO until the application closes the
accepted link (a second caller gets UNAVAILABLE "busy; queued at position N"
and ``grpc_link.connect`` retries until its timeout, keeping its place:
callers are admitted in order of arrival by identity, see ``admission.py``) --
checks the bearer token before reading anything, then expects HELLO. Any
protocol violation ends only that session -- with INVALID_ARGUMENT and a
one-line reason -- and the server goes on to accept the next one; so does
anything else that goes wrong in a handshake, the session callback's own bugs
included: the slot is always released.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import queue
import ssl
import threading
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Self

import grpc

from aisyn.net import join_host_port, split_host_port

from ._grpc_transport import (
    SERVICE,
    TOKEN_HEADER,
    GrpcLink,
    check_plaintext,
    grpc_options,
    identity,
    status_for,
)
from .admission import AdmissionQueue
from .base import LinkOptions, PeerHello, Service
from .certs import TlsConfig
from .data_listener import MAX_PENDING, DataListener
from .data_plane import FrameSocket, Plane, certificate_identity
from .errors import (
    AuthError,
    HandshakeError,
    LinkClosedError,
    LinkError,
    LinkTimeoutError,
    MalformedFrameError,
    PeerLostError,
)
from .frames import Inbound, check_hello, hello_frame, parse_frame
from .grpc_link import check_token
from .limits import ensure_fd_headroom

__all__ = ["Accept", "GrpcLinkServer", "certificate_subject", "token_identity"]

log = logging.getLogger(__name__)


#: descriptors a link server makes room for on its gRPC port (idle callers)
_CONTROL_FDS = 4096


class Accept(NamedTuple):
    """A session callback's answer that also hands the application something
    of its own with the session: ``reply`` goes to the client, ``agreed`` comes
    back as the accepted link's ``agreed`` attribute (e.g. the terms the hello
    was accepted on). Tied to that one connection, unlike anything keyed by
    the hello's text, which two clients may share. ``on_closed`` is called
    once the session is over -- closed by the application, or never opened
    (the client went away during the handshake) -- to release what the
    callback reserved for it."""

    reply: str
    agreed: object = None
    on_closed: Callable[[], None] | None = None


#: The server's reply session string, or a function of the client's HELLO
#: returning it (or an :class:`Accept`); raise HandshakeError to refuse the
#: session with a reason. Any other exception refuses it with a generic reason
#: and is logged on the server.
SessionReply = str | Callable[[PeerHello], str | Accept]


def token_identity(token: str | bytes) -> str:
    """The link's name for a client that presented ``token`` (hashed: an
    identity may be stored on disk, a token must not be)."""
    raw = token.encode() if isinstance(token, str) else token
    return "token-sha256:" + hashlib.sha256(b"aisyn-link\0" + raw).hexdigest()


def certificate_subject(der: bytes) -> str:
    """A certificate's subject as RFC 4514 text (``CN=...,O=...``); empty if
    it cannot be parsed (the TLS layer already verified it)."""
    from cryptography import x509

    try:
        return x509.load_der_x509_certificate(der).subject.rfc4514_string()
    except ValueError:
        return ""


class _ServerLink(GrpcLink):
    def __init__(
        self,
        context: grpc.ServicerContext,
        options: LinkOptions,
        name: str,
        peer: PeerHello,
        hello_nbytes: int,
        hello_reply: bytes,
        server_stopping: Callable[[], bool],
        agreed: object = None,
        on_closed: Callable[[], None] = lambda: None,
        on_ready: Callable[[GrpcLink], None] = lambda link: None,
        plane_wait: Callable[[GrpcLink], Plane] | None = None,
    ) -> None:
        super().__init__(options, name, peer, context.peer())
        self.agreed = agreed
        self._on_ready = on_ready
        self._plane_wait = plane_wait
        self._plane_offered = plane_wait is not None
        self._context = context
        self._server_stopping = server_stopping
        self._on_closed = on_closed
        self._served = threading.Event()  # the response stream has ended
        self._abort: tuple[grpc.StatusCode, str] | None = None
        self._received += hello_nbytes
        self._hello_reply = hello_reply
        self._sent += len(hello_reply)

    def serve(self, requests: Iterator[Inbound]) -> Iterator[bytes]:
        """Body of the response stream: runs until the session ends."""
        self._inbound = requests
        self._reader.start()
        self._start()
        try:
            # First, and outside the queue: a failure at once (which drops
            # what is queued) must not drop the HELLO, or the client would
            # take the session for never opened.
            yield self._hello_reply
            if self._plane_wait is not None:
                try:  # the HELLO told the client where; it dials now
                    self._attach(self._plane_wait(self))
                except LinkError as exc:  # the application never sees it
                    self._fail(exc, notify_peer=True)
                    self._on_closed()
                else:
                    self._on_ready(self)
            yield from self._outgoing()
            if self._abort is not None:
                self._context.abort(*self._abort)
        finally:
            self._served.set()

    def _teardown(self, exc: LinkError, notify_peer: bool) -> None:
        self._abort = (status_for(exc), str(exc))
        self._dead.set()
        self._shutdown_plane()
        self._push_end(drop_queued=True)

    def _shutdown(self, graceful: bool, timeout: float) -> None:
        try:
            if graceful:  # BYE is out; the client ends its half when it reads it
                self._reader.join(timeout)
            self._dead.set()
            self._push_end(drop_queued=True)
            # Let a pending abort status (the reason for a failure) go out
            # first: cancelling would replace it with a bare CANCELLED. Once the
            # response stream has ended gRPC finishes the call itself; cancel
            # only a call that is stuck.
            if not self._served.wait(timeout):
                self._context.cancel()
            self._reader.join(timeout)
            self._close_plane()
        finally:
            self._on_closed()

    def rpc_done(self) -> None:
        """gRPC callback: the call is over, for whatever reason."""
        self._dead.set()
        self._served.set()
        self._push_end(drop_queued=True)
        self._fail(PeerLostError(self._ended_abruptly()), notify_peer=False)

    def _fail(self, exc: LinkError, *, notify_peer: bool) -> None:
        # Whichever thread notices first, a stream cut by our own server's
        # stop() is not a lost peer.
        if isinstance(exc, PeerLostError) and self._server_stopping():
            exc = LinkClosedError("the link server was stopped")
        super()._fail(exc, notify_peer=notify_peer)

    def _ended_abruptly(self) -> str:
        # gRPC drops a call whose message exceeds the size limit before the
        # servicer sees it, so that case looks like a disconnect from here.
        return (
            f"{self._remote} ended the session without saying goodbye (it "
            "disconnected, cancelled, or sent a message over the gRPC size limit)"
        )


class GrpcLinkServer(Service):
    """Serves link sessions on ``listen`` ("host:port"; port 0 picks a free one).

    Usage::

        with GrpcLinkServer("0.0.0.0:50051", token=tok, tls=tls) as server:
            link = server.accept(timeout=600)   # one Link per client session
    """

    def __init__(
        self,
        listen: str,
        *,
        token: str | Collection[str],
        tls: TlsConfig | None = None,
        insecure: bool = False,
        allow_insecure_remote: bool = False,
        role: str = "B",
        session: SessionReply = "",
        options: LinkOptions | None = None,
        max_workers: int = 8,
        data_listen: str | None = None,
        max_sessions: int = 1,
        data_max_pending: int = MAX_PENDING,
    ) -> None:
        for address in (listen, data_listen) if data_listen else (listen,):
            check_plaintext(address, insecure, allow_insecure_remote, tls is not None)
        tokens = [token] if isinstance(token, str) else list(token)
        if not tokens:
            raise ValueError("a link server needs at least one token")
        for t in tokens:
            check_token(t)
        #: the tokens a client may present (several: one per tenant)
        self._tokens = [t.encode() for t in tokens]
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self._role = role
        self._session = session
        self._opts = options or LinkOptions()
        #: the session slots, taken in order of arrival by identity
        self._admission = AdmissionQueue(capacity=max_sessions)
        self._sessions: queue.Queue[GrpcLink] = queue.Queue()
        self._stopping = False
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Exchange": grpc.stream_stream_rpc_method_handler(
                    self._exchange,
                    request_deserializer=parse_frame,
                    response_serializer=identity,
                )
            },
        )
        # Each open session's stream holds a worker; a few more turn callers
        # away as busy while every slot is taken.
        workers = max(max_workers, max_sessions + 4)
        # gRPC handshakes on its own event loop and holds any number of idle
        # connections, until the descriptors run out: then it accepts nobody
        # ("File descriptor limit reached") until they time out. Room for a
        # thousand or more, and idle ones dropped after the link's handshake
        # timeout rather than gRPC's 120 s.
        ensure_fd_headroom(_CONTROL_FDS, "the link server")
        self._server = grpc.server(
            ThreadPoolExecutor(workers, thread_name_prefix="link-server"),
            handlers=[handler],
            options=grpc_options(self._opts, server=True)
            + [
                (
                    "grpc.server_handshake_timeout_ms",
                    int(self._opts.handshake_timeout_s * 1000),
                )
            ],
        )
        try:
            if tls is not None:
                creds = grpc.ssl_server_credentials(
                    [(tls.private_key, tls.cert_chain)],
                    root_certificates=tls.root_ca,
                    require_client_auth=True,
                )
                port = self._server.add_secure_port(listen, creds)
            else:
                port = self._server.add_insecure_port(listen)
        except RuntimeError as exc:
            raise LinkError(f"cannot listen on {listen}: {exc}") from None
        if not port:
            raise LinkError(f"cannot listen on {listen}")
        host = split_host_port(listen)[0]
        #: the bound port (useful with port 0) and a dialable "host:port"
        self.port: int = port
        self.address: str = join_host_port(host, port)
        #: the bulk data plane offered to every session (data_plane.py), if any
        self._plane = (
            DataListener(
                data_listen,
                tls,
                self._opts.handshake_timeout_s,
                max_pending=data_max_pending,
            )
            if data_listen is not None
            else None
        )
        #: its bound port (None without one)
        self.data_port: int | None = None if self._plane is None else self._plane.port

    def start(self) -> Self:
        self._server.start()
        log.info("link server listening on %s", self.address)
        return self

    def accept(self, timeout: float | None = None) -> GrpcLink:
        """The next session's link. Close it when done with it: the server
        takes no other session until then."""
        try:
            return self._sessions.get(timeout=timeout)
        except queue.Empty:
            raise LinkTimeoutError(
                f"no session on {self.address} within {timeout:g} s"
            ) from None

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving; an active session's link fails with LinkClosedError."""
        self._stopping = True
        self._server.stop(grace).wait(grace + 5.0)
        if self._plane is not None:
            self._plane.stop()

    # -- the servicer: validate, delegate, map errors to status codes

    def _exchange(
        self, requests: Iterator[Inbound], context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        remote = context.peer()
        try:
            token = self._authenticate(context)
        except AuthError as exc:
            log.warning("rejected session from %s: %s", remote, exc)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        der = self._certificate(context)
        # Who the client is, as the transport proves it: its certificate
        # under mutual TLS (clients may share a token, not a key), else the
        # token it passed.
        identity = certificate_identity(der) if der else token_identity(token)
        ticket = object()  # holds the slot until the session's link does
        place = self._admission.claim(identity, ticket)
        if place:
            # connect() retries, and keeps this place while it does.
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"server busy with another session; queued at position {place}",
            )
        link = None
        try:
            credentials = (identity, token_identity(token), der)
            link = self._open(requests, context, credentials, ticket)
        except (LinkError, ValueError) as exc:
            log.warning("refused session from %s: %s", remote, exc)
            code = status_for(exc) if isinstance(exc, LinkError) else None
            context.abort(code or grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception:  # a bug must neither escape nor keep the slot taken
            log.exception("handshake with %s failed", remote)
            context.abort(
                grpc.StatusCode.INTERNAL, "the server failed to open the session"
            )
        finally:
            if link is None:  # from here on the link's end of call releases it
                self._admission.release(ticket)
        yield from link.serve(requests)

    def _authenticate(self, context: grpc.ServicerContext) -> bytes:
        """The token the client presented, if it is one of ours."""
        metadata = dict(context.invocation_metadata())
        value = metadata.get(TOKEN_HEADER)
        if not isinstance(value, str) or not value.startswith("Bearer "):
            raise AuthError("missing bearer token")
        given = value.removeprefix("Bearer ").encode()
        # Every token is compared: the time taken says nothing of which matched.
        matches = [hmac.compare_digest(given, t) for t in self._tokens]
        if not any(matches):
            raise AuthError("invalid token")
        return self._tokens[matches.index(True)]

    @staticmethod
    def _certificate(context: grpc.ServicerContext) -> bytes:
        """The client certificate (DER) under mutual TLS; empty otherwise."""
        pem = context.auth_context().get("x509_pem_cert")
        return ssl.PEM_cert_to_DER_cert(pem[0].decode("ascii")) if pem else b""

    def _open(
        self,
        requests: Iterator[Inbound],
        context: grpc.ServicerContext,
        credentials: tuple[str, str, bytes],
        ticket: object,
    ) -> _ServerLink:
        identity, token_id, der = credentials
        peer, nbytes = self._read_hello(requests, context)
        peer = dataclasses.replace(
            peer,
            identity=identity,
            token_identity=token_id,
            subject=certificate_subject(der) if der else "",
        )
        answer = self._answer(peer, context.peer())
        released = answer.on_closed or (lambda: None)
        try:
            return self._open_agreed(context, peer, nbytes, answer, ticket, released)
        except BaseException:
            released()  # the session never opened (a no-op if it did, then closed)
            raise

    def _open_agreed(
        self,
        context: grpc.ServicerContext,
        peer: PeerHello,
        nbytes: int,
        answer: Accept,
        ticket: object,
        released: Callable[[], None],
    ) -> _ServerLink:
        identity = peer.identity
        name = f"link[{self._role}<-{context.peer()}]"
        plane_wait = None
        if self._plane is None:
            reply_frame = hello_frame(self._role, answer.reply)
        else:
            plane = self._plane
            secret, expected = plane.expect(identity)
            reply_frame = hello_frame(self._role, answer.reply, plane.port, secret)

            def plane_wait(link: GrpcLink) -> Plane:
                up, down = plane.wait(
                    expected, self._opts.handshake_timeout_s, link._dead.is_set
                )
                return Plane(FrameSocket(down, name), FrameSocket(up, name))

        link = _ServerLink(
            context,
            self._opts,
            name,
            peer,
            nbytes,
            reply_frame,
            server_stopping=lambda: self._stopping,
            agreed=answer.agreed,
            # The slot is free once the application is done with the session,
            # not when the call ends: a client that drops its calls at once
            # would otherwise pile up sessions (threads, buffers, gRPC call
            # state) faster than they are served.
            on_closed=lambda: closed(link),
            on_ready=self._ready,
            plane_wait=plane_wait,
        )

        def closed(link: _ServerLink) -> None:
            # What the application reserved first: the next session admitted
            # must find it free.
            released()
            self._admission.release(link)

        self._admission.hand_over(ticket, link)
        if not context.add_callback(link.rpc_done):
            self._admission.release(link)
            if self._plane is not None:
                self._plane.forget(expected)
            raise PeerLostError("client went away during the handshake")
        if plane_wait is None:  # else once its data plane is attached
            self._ready(link)
        return link

    def _ready(self, link: GrpcLink) -> None:
        log.info("%s: session open (peer role %r)", link._name, link.peer.role)
        self._sessions.put(link)

    def _answer(self, peer: PeerHello, remote: str) -> Accept:
        """The session callback's verdict on ``peer``'s HELLO."""
        if not callable(self._session):
            return Accept(self._session)
        try:
            answer = self._session(peer)
        except LinkError:  # HandshakeError: a refusal with its reason
            raise
        except Exception:  # a bug, or e.g. RecursionError on a crafted hello
            # Its text may describe server internals: log it, tell a generic one.
            log.exception("session callback failed on the hello from %s", remote)
            raise HandshakeError(
                "the server could not process the hello (see its log)"
            ) from None
        return answer if isinstance(answer, Accept) else Accept(answer)

    def _read_hello(
        self, requests: Iterator[Inbound], context: grpc.ServicerContext
    ) -> tuple[PeerHello, int]:
        timeout = self._opts.handshake_timeout_s
        timer = threading.Timer(timeout, context.cancel)
        timer.daemon = True
        timer.start()
        try:
            item = next(requests)
        except StopIteration:
            raise PeerLostError("client ended the stream before HELLO") from None
        except grpc.RpcError:
            raise LinkTimeoutError(f"no HELLO within {timeout:g} s") from None
        finally:
            timer.cancel()
        if item.frame is None:
            raise MalformedFrameError(item.error or "undecodable frame")
        return check_hello(item.frame), item.nbytes

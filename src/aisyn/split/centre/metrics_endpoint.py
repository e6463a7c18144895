"""The HTTP server behind ``aisyn split serve --metrics-listen``.

Plain HTTP, or HTTPS that asks every scraper for a client certificate signed
by the CA given (``--metrics-tls-cert``/``--metrics-tls-key``/
``--metrics-tls-ca``). Why not ``prometheus_client.start_http_server(certfile=...)``:
it wraps the listening socket, so each TLS handshake runs inside ``accept()``
on the one serving thread, and a single connection that never speaks stalls
every scrape for good. Here each connection's handshake and request run on
its own thread, under a deadline, and the listener goes on accepting.

Anyone who reaches the port may connect before any certificate is shown, so
what connections cost is bounded: at most ``MAX_CONNECTIONS`` are served at
once (a thread each; at the cap the oldest is cut, so a new scrape still gets
in), and each is cut ``CONNECTION_TIMEOUT_S`` after it was accepted, however
slowly it keeps sending (a socket timeout alone bounds each read, not the
whole: one byte every few seconds held a thread for good).

The page lists every tenant's name and use, so served in the clear off
loopback it is announced with a warning that says so.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from aisyn.net import is_loopback, join_host_port

log = logging.getLogger(__name__)

#: seconds a scraper has for its handshake and its request; past it the
#: connection is dropped (an idle one must not hold a thread forever)
CONNECTION_TIMEOUT_S = 10.0
#: connections served at once (a thread each); a new one past it cuts the oldest
MAX_CONNECTIONS = 32

#: what the page tells whoever reads it, for the warning
EXPOSES = (
    "every tenant's name and its steps, tokens, compute seconds, bytes, "
    "sessions, memory, queue wait and refusals"
)


@dataclass(frozen=True, slots=True)
class MetricsTls:
    """The endpoint's certificate and key, and the CA its scrapers' client
    certificates must be signed by (PEM files)."""

    cert: str | Path
    key: str | Path
    client_ca: str | Path

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.client_ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED  # no certificate, no page
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


class _Handler(WSGIRequestHandler):
    # StreamRequestHandler.setup() puts this on the connection's socket.
    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base's name
        """One stderr line per scrape would drown the server's own log."""


def _cut(watch: socket.socket) -> None:
    """End a connection under its handler (whose reads then see its end)."""
    with contextlib.suppress(OSError):
        watch.shutdown(socket.SHUT_RDWR)


class _Server(WSGIServer):
    tls: ssl.SSLContext | None = None
    #: dials the kernel queues for accept() (socketserver's default is 5: a
    #: burst past it waits a second for its SYN to be sent again)
    request_queue_size = 128

    def __init__(self, *args, **kwargs) -> None:
        self._lock = threading.Lock()
        #: the connections being served, oldest first: key -> (deadline, a
        #: duplicate of the socket, by which it is cut from this thread)
        self._open: dict[int, tuple[float, socket.socket]] = {}
        self._keys = itertools.count()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        """Serve one connection on a thread of its own, within the cap."""
        try:
            watch = request.dup()
        except OSError:  # out of descriptors: this one waits for none
            self.shutdown_request(request)
            return
        key = next(self._keys)
        with self._lock:
            while len(self._open) >= MAX_CONNECTIONS:
                oldest = next(iter(self._open))
                log.debug(
                    "metrics: %d connections open; cut the oldest", MAX_CONNECTIONS
                )
                _cut(self._open.pop(oldest)[1])
            self._open[key] = (time.monotonic() + CONNECTION_TIMEOUT_S, watch)
        threading.Thread(
            target=self._serve_one,
            args=(request, client_address, key, watch),
            name="tenant-metrics-conn",
            daemon=True,
        ).start()

    def _serve_one(self, request, client_address, key: int, watch) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self._lock:  # (never cut once closed: its number may be reused)
                self._open.pop(key, None)
            watch.close()

    def service_actions(self) -> None:
        """Each turn of the serving loop (every half second at most): cut
        the connections past their deadline."""
        now = time.monotonic()
        with self._lock:
            late = [k for k, (deadline, _) in self._open.items() if deadline <= now]
            for k in late:
                _cut(self._open.pop(k)[1])

    def finish_request(self, request, client_address) -> None:
        """On the connection's own thread: the TLS handshake, then the
        request (each read bounded by a timeout, the whole by the deadline
        ``service_actions`` keeps)."""
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(CONNECTION_TIMEOUT_S)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except OSError as e:  # no client certificate, a wrong one, a timeout
            log.debug("metrics: TLS handshake from %s refused: %s", client_address, e)
            return
        try:
            super().finish_request(conn, client_address)
        finally:
            conn.close()

    def handle_error(self, request, client_address) -> None:
        """A scraper that went away is no server error; socketserver's default
        would print a traceback for it."""
        log.debug("metrics: a request from %s failed", client_address, exc_info=True)


def serve_metrics(
    registry: CollectorRegistry, host: str, port: int, tls: MetricsTls | None = None
) -> tuple[WSGIServer, int]:
    """Serve ``registry`` on ``host:port`` (port 0: any free) from a daemon
    thread; (server, bound port). The context is built first, so bad TLS
    files are an error before anything listens."""
    context = tls.context() if tls is not None else None
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("_MetricsServer", (_Server,), {"address_family": family})
    server = server_class((host, port), _Handler)
    server.tls = context
    server.set_app(make_wsgi_app(registry))
    threading.Thread(
        target=server.serve_forever, name="tenant-metrics", daemon=True
    ).start()
    bound = server.server_address[1]
    url = f"{'https' if tls else 'http'}://{join_host_port(host, bound)}/metrics"
    if tls is not None:
        log.info(
            "per-tenant metrics on %s (client certificates signed by %s)",
            url,
            tls.client_ca,
        )
    elif is_loopback(host):
        log.info("per-tenant metrics on %s", url)
    else:
        log.warning(
            "per-tenant metrics on %s: plain HTTP with no authentication on a "
            "non-loopback address, so anyone who reaches it reads %s; serve it "
            "with --metrics-tls-cert, --metrics-tls-key and --metrics-tls-ca "
            "(client certificates), or keep it on loopback",
            url,
            EXPOSES,
        )
    return server, bound

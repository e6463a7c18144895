"""The HTTP server behind ``aisyn split serve --metrics-listen``.

Plain HTTP, or HTTPS that asks every scraper for a client certificate signed
by the CA given (``--metrics-tls-cert``/``--metrics-tls-key``/
``--metrics-tls-ca``). Why not ``prometheus_client.start_http_server(certfile=...)``:
it wraps the listening socket, so each TLS handshake runs inside ``accept()``
on the one serving thread, and a single connection that never speaks stalls
every scrape for good. Here each connection's handshake and request run on
its own thread, under a deadline, and the listener goes on accepting.

The page lists every tenant's name and use, so served in the clear off
loopback it is announced with a warning that says so.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from aisyn.net import is_loopback, join_host_port

log = logging.getLogger(__name__)

#: seconds a scraper has for its handshake and its request; past it the
#: connection is dropped (an idle one must not hold a thread forever)
CONNECTION_TIMEOUT_S = 10.0

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


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def finish_request(self, request, client_address) -> None:
        """On the connection's own thread: the TLS handshake (bounded by the
        handler's timeout), then the request."""
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

"""The per-tenant metrics endpoint's doors: mutual TLS when asked (a scraper
without a client certificate the CA signed reads nothing), a warning when it
is served in the clear off loopback, and no stall from a silent connection."""

import json
import logging
import socket
import ssl
import time
import urllib.error
import urllib.request

import pytest

from aisyn.cli import main
from aisyn.link.certs import make_dev_certs
from aisyn.split.centre import metrics_endpoint
from aisyn.split.centre.metrics_endpoint import MetricsTls
from aisyn.split.centre.tenant_metrics import SessionRecord, TenantMetrics


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The endpoint's CA apart from any link's: scrapers' certificates are
    signed by it (``a``), the endpoint's is ``b``; ``other`` is a stranger's."""
    folder = tmp_path_factory.mktemp("metrics-pki")
    return make_dev_certs(folder / "ours"), make_dev_certs(folder / "other")


@pytest.fixture
def metrics():
    m = TenantMetrics()
    record = SessionRecord("hospital", "run-1", "train", time.time(), 0.5, 1e6)
    m.opened(record)
    m.round(record, steps=2, tokens=64, compute_s=0.1, received=10, sent=20)
    yield m
    m.stop()


def _client_context(ca, cert=None, key=None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def _get(port: int, ctx: ssl.SSLContext | None) -> str:
    scheme = "https" if ctx else "http"
    url = f"{scheme}://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5, context=ctx) as reply:
        return reply.read().decode()


def test_a_tls_scrape_with_a_client_certificate_reads_the_tenants(pki, metrics, capsys):
    ours, _ = pki
    port = metrics.serve(
        "127.0.0.1:0", MetricsTls(ours.server_cert, ours.server_key, ours.ca_cert)
    )

    page = _get(port, _client_context(ours.ca_cert, ours.client_cert, ours.client_key))
    assert 'aisyn_tenant_steps_total{tenant="hospital"} 2.0' in page
    # and `aisyn split status` reads it with the same flags as the link's
    tls = [
        "--tls-cert", str(ours.client_cert), "--tls-key", str(ours.client_key),
        "--tls-ca", str(ours.ca_cert),
    ]  # fmt: skip
    address = f"127.0.0.1:{port}"
    assert main(["split", "status", "--metrics", address, "--json", *tls]) == 0
    assert json.loads(capsys.readouterr().out)["hospital"]["steps_total"] == 2


def test_a_scrape_without_a_good_client_certificate_is_refused(pki, metrics, capsys):
    ours, other = pki
    port = metrics.serve(
        "127.0.0.1:0", MetricsTls(ours.server_cert, ours.server_key, ours.ca_cert)
    )

    refused = (ssl.SSLError, ConnectionError, urllib.error.URLError)
    with pytest.raises(refused):  # no client certificate
        _get(port, _client_context(ours.ca_cert))
    with pytest.raises(refused):  # one another CA signed
        _get(port, _client_context(ours.ca_cert, other.client_cert, other.client_key))
    with pytest.raises(refused):  # plain HTTP
        _get(port, None)
    address = f"127.0.0.1:{port}"
    assert main(["split", "status", "--metrics", address, "--timeout", "5"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("aisyn: error: cannot read http://")
    # and the endpoint still serves a scraper that has one
    ctx = _client_context(ours.ca_cert, ours.client_cert, ours.client_key)
    assert "hospital" in _get(port, ctx)


def test_a_silent_connection_does_not_stall_the_tls_endpoint(pki, metrics):
    """prometheus_client's own TLS server shakes hands inside accept(): one
    connection that never speaks would stop every scrape."""
    ours, _ = pki
    port = metrics.serve(
        "127.0.0.1:0", MetricsTls(ours.server_cert, ours.server_key, ours.ca_cert)
    )
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        ctx = _client_context(ours.ca_cert, ours.client_cert, ours.client_key)
        assert "hospital" in _get(port, ctx)
    finally:
        for s in silent:
            s.close()


def test_plain_http_off_loopback_is_served_with_a_warning(metrics, monkeypatch, caplog):
    """The address asked for is a wildcard; the test binds loopback in its
    place (nothing here listens beyond this machine), the warning is about
    the address asked for."""
    bind = metrics_endpoint._Server.server_bind

    def bind_loopback(server):
        server.server_address = ("127.0.0.1", server.server_address[1])
        bind(server)

    monkeypatch.setattr(metrics_endpoint._Server, "server_bind", bind_loopback)

    with caplog.at_level(logging.INFO, logger="aisyn.split.centre.metrics_endpoint"):
        port = metrics.serve("0.0.0.0:0")

    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = warning.getMessage()
    assert text.startswith(f"per-tenant metrics on http://0.0.0.0:{port}/metrics")
    assert "no authentication" in text and "every tenant's name" in text
    assert "--metrics-tls-cert" in text
    assert "hospital" in _get(port, None)


def test_plain_http_on_loopback_is_not_warned_about(metrics, caplog):
    with caplog.at_level(logging.INFO, logger="aisyn.split.centre.metrics_endpoint"):
        metrics.serve("127.0.0.1:0")
    assert [r.levelname for r in caplog.records] == ["INFO"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--metrics-tls-cert", "C"], "go together"),
        (["--metrics-tls-cert", "C", "--metrics-tls-key", "K"], "go together"),
        (["--metrics-tls-ca", "A"], "no --metrics-listen"),
    ],
    ids=["cert only", "no ca", "no listen"],
)
def test_serve_refuses_half_a_metrics_tls_setup(pki, tmp_path, capsys, flags, message):
    ours, _ = pki
    files = {"C": ours.server_cert, "K": ours.server_key, "A": ours.ca_cert}
    flags = [str(files.get(f, f)) for f in flags]
    listen = (
        [] if message == "no --metrics-listen" else ["--metrics-listen", "127.0.0.1:0"]
    )
    argv = [
        "split", "serve", "--listen", "127.0.0.1:0", "--model", "tiny",
        "--out", str(tmp_path / "b"), "--insecure", *listen, *flags,
    ]  # fmt: skip
    assert main(argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("aisyn: error: --metrics-tls-") and message in line
    assert not (tmp_path / "b").exists()


def _endpoint_threads() -> int:
    import threading

    return sum(t.name == "tenant-metrics-conn" for t in threading.enumerate())


def test_a_flood_of_connections_holds_a_bounded_number_of_threads(metrics):
    """Anyone who reaches the port may connect: each connection held a thread
    of its own (socketserver's ThreadingMixIn), so a flood of silent ones
    held as many threads as it liked. Now at most MAX_CONNECTIONS are served;
    past it the oldest is cut, and a scrape still gets in."""
    import threading

    cap = metrics_endpoint.MAX_CONNECTIONS
    before = threading.active_count()
    port = metrics.serve("127.0.0.1:0")
    flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(3 * cap)]
    try:
        # (all accepted by the time the oldest sees its end, or 5 s)
        flood[0].settimeout(0.1)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if flood[0].recv(1, socket.MSG_PEEK) == b"":
                    break
            except TimeoutError:
                pass
        time.sleep(0.3)
        assert threading.active_count() - before <= cap + 4
        assert "hospital" in _get(port, None)
    finally:
        for s in flood:
            s.close()


@pytest.mark.heavy
def test_a_connection_that_sends_slowly_is_cut_at_its_deadline(metrics, monkeypatch):
    """A socket timeout bounds each read, not the connection: one byte of a
    request every 0.3 s held its thread for good. It is cut
    CONNECTION_TIMEOUT_S after it was accepted."""
    monkeypatch.setattr(metrics_endpoint, "CONNECTION_TIMEOUT_S", 1.0)
    port = metrics.serve("127.0.0.1:0")
    slow = socket.create_connection(("127.0.0.1", port))
    slow.settimeout(0.3)
    t0 = time.monotonic()
    cut_after = None
    try:
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n" * 2:
            slow.sendall(bytes([byte]))
            try:
                if slow.recv(1) == b"":
                    cut_after = time.monotonic() - t0
                    break
            except TimeoutError:
                pass
            except OSError:
                cut_after = time.monotonic() - t0
                break
            if time.monotonic() - t0 > 6:
                break
    finally:
        slow.close()
    assert cut_after is not None and cut_after < 3.0

"""What a flood of unauthenticated connections costs a data-plane listener.

Holds ``--connections`` connections to a ``DataListener`` (mutual TLS, dev
certificates), each from its own loopback address, first idle, then each
having sent the first bytes of a TLS ClientHello (which makes the listener
create its TLS state for it), and prints how many the listener holds and what
its process's resident memory grew by -- with the default cap and with
``--cap``. Then an honest dial with the session's certificate and secret must
still attach: the time it took is printed.

    python bench/data_plane_flood.py
"""

from __future__ import annotations

import argparse
import resource
import socket
import tempfile
import time

from aisyn.link import make_dev_certs
from aisyn.link.data_listener import MAX_PENDING, DataListener
from aisyn.link.data_plane import dial


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _flood(port: int, count: int) -> list[socket.socket]:
    held = []
    for i in range(count):
        s = socket.socket()
        s.bind((f"127.0.{2 + i // 250}.{1 + i % 250}", 0))
        s.connect(("127.0.0.1", port))
        held.append(s)
    return held


def run(cap: int, count: int, pki) -> None:
    listener = DataListener("127.0.0.1:0", pki.server_tls(), 30.0, max_pending=cap)
    try:
        time.sleep(0.2)
        before = _rss_mib()
        held = _flood(listener.port, count)
        time.sleep(1.0)
        idle = _rss_mib() - before
        for s in held:
            s.sendall(b"\x16\x03\x01\x02\x00")  # a ClientHello's record header
        time.sleep(1.5)
        started = _rss_mib() - before
        secret, expected = listener.expect(_client_identity(pki))
        t0 = time.monotonic()
        up, down = dial(
            f"127.0.0.1:{listener.port}", secret, pki.client_tls(), "127.0.0.1", 10
        )
        listener.wait(expected, 10, lambda: False)
        took = time.monotonic() - t0
        print(
            f"cap {cap}: {count} connections dialled, {listener.pending()} held "
            f"(peak {listener.peak_pending}); RSS +{idle:.1f} MiB idle, "
            f"+{started:.1f} MiB once each began a handshake; an honest dial "
            f"attached in {took * 1000:.0f} ms"
        )
        up.close()
        down.close()
        for s in held:
            s.close()
    finally:
        listener.stop()


def _client_identity(pki) -> str:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from aisyn.link import certificate_identity

    cert = x509.load_pem_x509_certificate(pki.client_cert.read_bytes())
    return certificate_identity(cert.public_bytes(serialization.Encoding.DER))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--cap", type=int, default=256)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * args.connections + 512
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    pki = make_dev_certs(tempfile.mkdtemp(prefix="aisyn-flood-"))
    for cap in (MAX_PENDING, args.cap):
        run(cap, args.connections, pki)


if __name__ == "__main__":
    main()

"""The link server's session slot is handed out in order of arrival by
identity (issue 17, item 11): one credential holder that reconnects the moment
its session ends goes behind a party that waited, and a waiting client is
told its place in the queue."""

from __future__ import annotations

import hashlib
import logging
import ssl
import threading
import time
from pathlib import Path

import pytest
from linkutil import FAST, TOKEN

from aisyn.link import GrpcLinkServer, PeerLostError, connect, make_dev_certs
from aisyn.link.admission import AdmissionQueue
from aisyn.link.certs import TlsConfig


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_queue_serves_identities_in_order_of_arrival():
    clock = Clock()
    q = AdmissionQueue(forget_s=5.0, clock=clock)
    x, y, z = object(), object(), object()
    assert q.claim("mallory", x) == 0  # a free slot, nobody waiting
    assert q.claim("alice", y) == 1
    assert q.claim("bob", z) == 2
    assert q.claim("alice", y) == 1  # asking again keeps the place
    q.release(x)
    clock.now = 1.0
    assert q.claim("mallory", x) == 3  # back at once: behind those who waited
    assert q.claim("bob", z) == 2  # free, but alice is next
    assert q.claim("alice", y) == 0
    assert q.waiting() == ["bob", "mallory"]
    q.release(y)
    clock.now = 7.0  # bob stopped asking: he gave up
    assert q.claim("mallory", x) == 0
    assert q.waiting() == []


def test_a_full_queue_tells_without_queueing():
    q = AdmissionQueue(max_waiting=2, clock=Clock())
    holder = object()
    assert q.claim("a", holder) == 0
    assert [q.claim(name, object()) for name in ("b", "c", "d")] == [1, 2, 3]
    assert q.waiting() == ["b", "c"]


def test_release_and_hand_over_only_by_the_holder():
    q = AdmissionQueue(clock=Clock())
    ticket, link, other = object(), object(), object()
    assert q.claim("a", ticket) == 0
    assert not q.hand_over(other, link)
    assert q.hand_over(ticket, link)
    q.release(ticket)  # no longer the holder: the slot stays taken
    assert q.claim("b", other) == 1
    q.release(link)
    assert q.claim("b", other) == 0


@pytest.fixture(scope="module")
def two_clients(tmp_path_factory):
    certs = make_dev_certs(tmp_path_factory.mktemp("certs"), more_clients=["alice"])
    alice_cert, alice_key = certs.other_client("alice")
    return (
        certs,
        certs.client_tls(),
        TlsConfig.from_files(alice_cert, alice_key, certs.ca_cert),
    )


def dial(srv, tls, timeout: float):
    return connect(srv.address, token=TOKEN, tls=tls, options=FAST, timeout=timeout)


@pytest.mark.heavy
def test_a_reconnecting_holder_goes_behind_a_waiting_party(two_clients, caplog):
    certs, mallory, alice = two_clients
    caplog.set_level(logging.INFO, logger="aisyn.link")
    with GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, tls=certs.server_tls(), options=FAST
    ) as srv:
        m_link = dial(srv, mallory, 5)
        m_server = srv.accept(timeout=5)
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(dial(srv, alice, 20)))
        waiter.start()
        deadline = time.monotonic() + 10
        while len(srv._admission.waiting()) < 1:  # alice is queued
            assert time.monotonic() < deadline, "alice was never queued"
            time.sleep(0.02)
        # Mallory's session ends and she dials again at once, again and again.
        m_link.close()
        m_server.close()
        with pytest.raises(PeerLostError, match="busy.*queued at position 1"):
            dial(srv, mallory, 3)
        waiter.join(20)
        assert got, "alice never got in"
        a_server = srv.accept(timeout=5)
        assert a_server.peer.identity == fingerprint(certs.other_client("alice")[0])
        assert m_server.peer.identity == fingerprint(certs.client_cert)
        got[0].close()
        a_server.close()
    assert "queued at position 1" in caplog.text  # alice's client said where


def fingerprint(cert: Path) -> str:
    """The identity the server gives the holder of ``cert``."""
    der = ssl.PEM_cert_to_DER_cert(cert.read_text())
    return "x509-sha256:" + hashlib.sha256(der).hexdigest()

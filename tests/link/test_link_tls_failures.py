"""Certificates that cannot work end ``connect`` at once, in one line that
names the cause; what may heal (a server not up yet) is retried, and each
kind of failure is logged once, not once per attempt.

Before, gRPC's UNAVAILABLE for a hostname mismatch, a foreign CA or an
expired certificate was retried for the whole connect timeout (150 s in
``aisyn split train``), with a WARNING per attempt.
"""

from __future__ import annotations

import datetime as dt
import logging
import socket
import time

import pytest
from linkutil import FAST, TOKEN

import aisyn.link.certs as certs_module
from aisyn.link import (
    AuthError,
    CertificateError,
    GrpcLinkServer,
    PeerLostError,
    TlsConfig,
    connect,
    make_dev_certs,
)

#: long enough that a retry loop would still be retrying when the test fails
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def pkis(tmp_path_factory):
    base = tmp_path_factory.mktemp("pki")
    good = make_dev_certs(base / "good")
    other = make_dev_certs(base / "other")
    localhost = make_dev_certs(base / "localhost", hosts=["localhost"])
    real = certs_module._builder

    def expired(subject, issuer, key, not_before, not_after):
        return real(
            subject,
            issuer,
            key,
            not_before - dt.timedelta(days=10),
            not_before - dt.timedelta(days=5),
        )

    certs_module._builder = expired
    try:
        old = make_dev_certs(base / "expired")
    finally:
        certs_module._builder = real
    return {"good": good, "other": other, "localhost": localhost, "expired": old}


def _mixed(cert_of, ca_of) -> TlsConfig:
    mine, theirs = cert_of.client_tls(), ca_of.client_tls()
    return TlsConfig(mine.cert_chain, mine.private_key, theirs.root_ca)


def _cases(p):
    good, other, old = p["good"], p["other"], p["expired"]
    expired_server = TlsConfig(
        old.server_tls().cert_chain,
        old.server_tls().private_key,
        good.ca_cert.read_bytes(),
    )
    return {
        # server's certificate | what the client holds | the message names
        "name": (p["localhost"].server_tls(), p["localhost"].client_tls(), "localhost"),
        "untrusted": (good.server_tls(), _mixed(good, other), "not signed by our CA"),
        "refused": (good.server_tls(), _mixed(other, good), "does not accept our"),
        "expired": (expired_server, _mixed(good, old), "expired"),
        "own expired": (
            good.server_tls(),
            _mixed(old, good),
            "our certificate expired",
        ),
    }


@pytest.mark.parametrize(
    "case", ["name", "untrusted", "refused", "expired", "own expired"]
)
def test_certificates_that_cannot_work_fail_at_once(pkis, case, caplog):
    server_tls, client_tls, named = _cases(pkis)[case]
    with GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, tls=server_tls, options=FAST
    ) as srv:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="aisyn.link"):
            with pytest.raises(CertificateError, match=named) as info:
                connect(
                    srv.address,
                    token=TOKEN,
                    tls=client_tls,
                    options=FAST,
                    timeout=TIMEOUT_S,
                )
        assert time.monotonic() - t0 < 5.0
    assert "\n" not in str(info.value)
    assert isinstance(info.value, AuthError)  # a credential problem
    # nothing per attempt: at most the server's own line about the refusal
    client_lines = [r for r in caplog.records if "link[A->" in r.getMessage()]
    assert client_lines == []


def test_a_name_mismatch_names_the_certificates_hosts(pkis):
    p = pkis["localhost"]
    with GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, tls=p.server_tls(), options=FAST
    ) as srv:
        with pytest.raises(CertificateError) as info:
            connect(
                srv.address,
                token=TOKEN,
                tls=p.client_tls(),
                options=FAST,
                timeout=TIMEOUT_S,
            )
    e = info.value
    assert (e.kind, e.hosts, e.dialled, e.port) == (
        "name",
        ["localhost"],
        "127.0.0.1",
        srv.port,
    )
    assert "is for localhost, not 127.0.0.1" in str(e)
    # dialled by a name the certificate is for, the same files work
    with GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, tls=p.server_tls(), options=FAST
    ) as srv:
        link = connect(
            f"localhost:{srv.port}",
            token=TOKEN,
            tls=p.client_tls(),
            options=FAST,
            timeout=5,
        )
        srv.accept(timeout=5).close()
        link.close()


@pytest.mark.heavy
def test_a_server_not_up_yet_is_retried_with_one_line(pkis, caplog):
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger="aisyn.link"):
        with pytest.raises(PeerLostError, match="within 2 s"):
            connect(
                f"127.0.0.1:{port}",
                token=TOKEN,
                tls=pkis["good"].client_tls(),
                options=FAST,
                timeout=2.0,
            )
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "retrying for up to 2 s" in lines[0], lines


def test_an_open_session_that_fails_is_still_logged(pkis, caplog):
    """Quiet while connecting, not after: a session lost later is news."""
    good = pkis["good"]
    with GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, tls=good.server_tls(), options=FAST
    ) as srv:
        a = connect(
            srv.address, token=TOKEN, tls=good.client_tls(), options=FAST, timeout=5
        )
        b = srv.accept(timeout=5)
        with caplog.at_level(logging.WARNING, logger="aisyn.link"):
            b.abort("the compute party is shutting down")
            with pytest.raises(PeerLostError, match="shutting down"):
                a.recv("grad", step=0, timeout=10)
        a.close()
        b.close()
    assert any(
        "link[A->" in r.getMessage() and r.levelno == logging.WARNING
        for r in caplog.records
    )

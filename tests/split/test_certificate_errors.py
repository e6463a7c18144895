"""``aisyn split train`` against a compute party whose certificate cannot
work: one line at once that names the certificate's hosts and the fix, not
150 s of retries with a warning per attempt (issue 37, item 10)."""

from __future__ import annotations

import logging
import time

from aisyn.cli import main
from aisyn.link import GrpcLinkServer, LinkOptions, TlsConfig


def test_split_train_stops_at_once_on_a_certificate_for_another_name(
    tmp_path, news_data, capsys, caplog
):
    creds = tmp_path / "creds"
    assert main(["certs", "--out", str(creds), "--host", "localhost"]) == 0
    capsys.readouterr()
    server_tls = TlsConfig.from_files(
        creds / "b.pem", creds / "b.key", creds / "ca.pem"
    )
    token = (creds / "token").read_text().strip()
    with GrpcLinkServer(
        "127.0.0.1:0",
        token=token,
        tls=server_tls,
        options=LinkOptions(close_timeout_s=2.0),
    ) as srv:
        port = srv.port
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="aisyn.link"):
            code = main(
                [
                    "split", "train", "--mode", "grpc",
                    "--peer", f"127.0.0.1:{port}",
                    "--model", "tiny", "--cut", "u:1,1",
                    "--tls-cert", str(creds / "a.pem"),
                    "--tls-key", str(creds / "a.key"),
                    "--tls-ca", str(creds / "ca.pem"),
                    "--token-file", str(creds / "token"),
                    "--data", str(news_data), "--out", str(tmp_path / "a"),
                    "--steps", "1",
                ]
            )  # fmt: skip
        elapsed = time.monotonic() - t0
    assert code == 2
    errors = [
        line
        for line in capsys.readouterr().err.splitlines()
        if line.startswith("aisyn: error:")
    ]
    assert errors == [
        f"aisyn: error: TLS with 127.0.0.1:{port} failed: the certificate of "
        f"127.0.0.1:{port} is for localhost, not 127.0.0.1; dial a name it is for "
        f"(--peer localhost:{port}) or make B's certificate for 127.0.0.1 "
        "(aisyn certs --host 127.0.0.1)"
    ]
    assert not [r for r in caplog.records if "link[A->" in r.getMessage()]
    assert elapsed < 60  # the connect timeout is 150 s


def test_the_fix_names_the_flag_that_chose_the_name():
    from aisyn.link import CertificateError
    from aisyn.split.session import certificate_fix

    e = CertificateError(
        "the certificate of 10.0.0.2:50051 is for b.example.org, not b.other.org",
        kind="name",
        hosts=["b.example.org"],
        dialled="b.other.org",
        port=50051,
    )
    assert "(--peer b.example.org:50051)" in certificate_fix(e)
    # with --server-name, that flag chose the name checked, not --peer's host
    fix = certificate_fix(e, server_name="b.other.org")
    assert "(--server-name b.example.org)" in fix
    assert "aisyn certs --host b.other.org" in fix
    v6 = CertificateError("", kind="name", hosts=["::1"], dialled="127.0.0.1", port=7)
    assert "(--peer [::1]:7)" in certificate_fix(v6)

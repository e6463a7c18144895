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

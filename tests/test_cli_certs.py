"""``aisyn certs``: development credentials under the names the docs use, that
the link accepts, never silently replaced."""

import stat

import pytest
from cryptography import x509

from aisyn.cli import main
from aisyn.link import GrpcLinkServer, LinkOptions, connect
from aisyn.link.certs import TlsConfig

NAMES = ["a.key", "a.pem", "b.key", "b.pem", "ca.pem", "token"]


def test_certs_writes_the_documented_files(tmp_path, capsys):
    out = tmp_path / "creds"

    assert main(["certs", "--out", str(out), "--host", "b.example.org"]) == 0

    assert sorted(p.name for p in out.iterdir()) == NAMES
    for private in ("a.key", "b.key", "token"):
        assert stat.S_IMODE((out / private).stat().st_mode) == 0o600
    b = x509.load_pem_x509_certificate((out / "b.pem").read_bytes())
    sans = b.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert sans.value.get_values_for_type(x509.DNSName) == ["b.example.org"]
    # the files make a working mutual-TLS link, token included
    token = (out / "token").read_text().strip()
    assert len(token) >= 40
    fast = LinkOptions(handshake_timeout_s=5.0, close_timeout_s=2.0)
    server_tls = TlsConfig.from_files(out / "b.pem", out / "b.key", out / "ca.pem")
    client_tls = TlsConfig.from_files(
        out / "a.pem", out / "a.key", out / "ca.pem", server_name="b.example.org"
    )
    with GrpcLinkServer(
        "127.0.0.1:0", token=token, tls=server_tls, options=fast
    ) as srv:
        a = connect(srv.address, token=token, tls=client_tls, timeout=5, options=fast)
        b = srv.accept(timeout=5)
        a.send_scalar("ok", 1.0, step=0)
        assert b.recv_scalar("ok", step=0, timeout=5) == 1.0
        a.close()
        b.close()
    assert "--tls-cert" in capsys.readouterr().out


def test_certs_refuses_to_replace_credentials(tmp_path, capsys):
    out = tmp_path / "creds"
    main(["certs", "--out", str(out)])
    token = (out / "token").read_text()

    assert main(["certs", "--out", str(out)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert (out / "token").read_text() == token
    assert main(["certs", "--out", str(out), "--overwrite"]) == 0
    assert (out / "token").read_text() != token


def test_certs_rejects_a_bad_host(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["certs", "--out", str(tmp_path), "--host", "bad host,x"])
    assert e.value.code == 2
    assert "neither an IP address nor an ASCII host name" in capsys.readouterr().err

"""``aisyn certs``: development credentials under the names the docs use, that
the link accepts, never silently replaced."""

import os
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from aisyn.cli import main
from aisyn.link import GrpcLinkServer, LinkOptions, connect
from aisyn.link.certs import TlsConfig, make_dev_certs
from aisyn.link.data_plane import certificate_identity

NAMES = ["a.key", "a.pem", "b.key", "b.pem", "ca.pem", "token"]
FAST = LinkOptions(handshake_timeout_s=5.0, close_timeout_s=2.0)


def test_certs_writes_the_documented_files(tmp_path, capsys):
    out = tmp_path / "creds"

    assert main(["certs", "--out", str(out), "--host", "b.example.org"]) == 0

    # no ca.key: this folder is copied to both parties, and whoever holds the
    # CA's key can sign a certificate for B's name
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


def _contents(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if not p.is_symlink()}


def test_certs_refuses_a_dangling_link_out_of_the_folder(tmp_path, capsys):
    out = tmp_path / "creds"
    out.mkdir()
    (out / "token").symlink_to("../elsewhere")

    assert main(["certs", "--out", str(out)]) == 2

    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "token is a symbolic link" in err
    assert not (tmp_path / "elsewhere").exists()
    assert [p.name for p in out.iterdir()] == ["token"]  # nothing else written


def test_certs_overwrite_never_writes_through_a_link(tmp_path, capsys):
    out = tmp_path / "creds"
    main(["certs", "--out", str(out)])
    precious = tmp_path / "precious.txt"
    precious.write_text("precious\n")
    (out / "a.key").unlink()
    (out / "a.key").symlink_to("../precious.txt")
    before = _contents(out)
    capsys.readouterr()

    assert main(["certs", "--out", str(out), "--overwrite"]) == 2

    assert "a.key is a symbolic link" in capsys.readouterr().err
    assert precious.read_text() == "precious\n"
    assert _contents(out) == before  # refused before anything was replaced


def test_certs_overwrite_replaces_a_hard_link_not_its_target(tmp_path):
    out = tmp_path / "creds"
    main(["certs", "--out", str(out)])
    precious = tmp_path / "precious.txt"
    precious.write_text("precious\n")
    os.chmod(precious, 0o644)
    (out / "a.key").unlink()
    os.link(precious, out / "a.key")

    assert main(["certs", "--out", str(out), "--overwrite"]) == 0

    assert precious.read_text() == "precious\n"
    assert stat.S_IMODE(precious.stat().st_mode) == 0o644
    key = out / "a.key"
    assert b"PRIVATE KEY" in key.read_bytes()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert sorted(p.name for p in out.iterdir()) == NAMES  # no temporary left


@pytest.mark.parametrize("days", ["1000000000", "3000000"])
def test_certs_days_past_x509s_last_date_is_one_line(tmp_path, capsys, days):
    with pytest.raises(SystemExit) as e:
        main(["certs", "--out", str(tmp_path / "creds"), "--days", days])

    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "9999-12-31" in err
    assert not (tmp_path / "creds").exists()
    with pytest.raises(ValueError, match="9999-12-31"):
        make_dev_certs(tmp_path / "lib", days=int(days))


def test_certs_longest_validity_ends_by_9999(tmp_path):
    from aisyn.link.certs import max_days

    out = tmp_path / "creds"
    assert main(["certs", "--out", str(out), "--days", str(max_days())]) == 0
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    assert ca.not_valid_after_utc.year == 9999


def test_certs_client_is_signed_by_the_folders_ca(tmp_path, capsys):
    out = tmp_path / "creds"
    main(["certs", "--out", str(out), "--host", "localhost", "--keep-ca-key"])
    capsys.readouterr()
    assert stat.S_IMODE((out / "ca.key").stat().st_mode) == 0o600

    assert main(["certs", "--out", str(out), "--client", "hospital"]) == 0

    printed = capsys.readouterr().out
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((out / "hospital.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    assert cert.subject.rfc4514_string() == "CN=hospital"
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert stat.S_IMODE((out / "hospital.key").stat().st_mode) == 0o600
    der = cert.public_bytes(serialization.Encoding.DER)
    assert f'certificate = "{certificate_identity(der)}"' in printed
    # B's server accepts it as a client, and sees who it is
    token = (out / "token").read_text().strip()
    server_tls = TlsConfig.from_files(out / "b.pem", out / "b.key", out / "ca.pem")
    client_tls = TlsConfig.from_files(
        out / "hospital.pem", out / "hospital.key", out / "ca.pem"
    )
    with GrpcLinkServer(
        "127.0.0.1:0", token=token, tls=server_tls, options=FAST
    ) as srv:
        a = connect(
            srv.address.replace("127.0.0.1", "localhost"),
            token=token,
            tls=client_tls,
            timeout=5,
            options=FAST,
        )
        b = srv.accept(timeout=5)
        a.send_scalar("ok", 1.0, step=0)
        assert b.recv_scalar("ok", step=0, timeout=5) == 1.0
        a.close()
        b.close()
    # a second one is refused without --overwrite, and nothing is replaced
    before = _contents(out)
    assert main(["certs", "--out", str(out), "--client", "hospital"]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert _contents(out) == before


def test_certs_client_needs_the_cas_key(tmp_path, capsys):
    old = tmp_path / "old"
    main(["certs", "--out", str(old)])  # without --keep-ca-key

    assert main(["certs", "--out", str(old), "--client", "hospital"]) == 2

    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ca.key: no CA key here" in err
    assert not (old / "hospital.pem").exists()
    # a CA key that is not ca.pem's is refused too
    other = tmp_path / "other"
    main(["certs", "--out", str(other), "--keep-ca-key"])
    (old / "ca.key").write_bytes((other / "ca.key").read_bytes())
    capsys.readouterr()
    assert main(["certs", "--out", str(old), "--client", "hospital"]) == 2
    assert "is not the key of" in capsys.readouterr().err
    assert not (old / "hospital.pem").exists()


@pytest.mark.parametrize("name", ["../outside", "b", "ca", "", "CA", "B"])
def test_certs_client_names_stay_in_the_folder(tmp_path, capsys, name):
    """("CA", "B": on a case-insensitive file system, as macOS's by default,
    CA.key is ca.key: --client CA --overwrite replaced the CA's key.)"""
    from aisyn.link.certs import issue_client

    out = tmp_path / "creds"
    main(["certs", "--out", str(out), "--keep-ca-key"])
    before = _contents(out)
    with pytest.raises(SystemExit) as e:
        main(["certs", "--out", str(out), "--client", name])
    assert e.value.code == 2
    assert "argument --client" in capsys.readouterr().err
    with pytest.raises(ValueError, match="client"):
        issue_client(out, name)
    assert _contents(out) == before and not (tmp_path / "outside.pem").exists()

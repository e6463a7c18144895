"""One TLS flag vocabulary for `aisyn split` and `aisyn fl`; the federated
commands' earlier spellings still work for one release, hidden from --help."""

from __future__ import annotations

import pytest

from aisyn.cli import build_parser
from aisyn.link import make_dev_certs

FL_SERVER = ["fl", "server", "--base", "b", "--out", "o"]
FL_CLIENT = ["fl", "client", "--superlink", "10.0.0.1:9092", "--name", "acme"]
FL_CLIENT += ["--data", "d", "--base", "b", "--out", "o"]
SPLIT_SERVE = ["split", "serve", "--listen", "127.0.0.1:0", "--model", "tiny"]
SPLIT_SERVE += ["--cut", "u:1,1"]


@pytest.fixture(scope="module")
def pem(tmp_path_factory):
    certs = make_dev_certs(tmp_path_factory.mktemp("certs"))
    return str(certs.server_cert), str(certs.server_key), str(certs.ca_cert)


def _tls(args) -> tuple:
    return args.tls_cert, args.tls_key, args.tls_ca, args.allow_insecure_remote


def test_split_and_fl_take_the_same_tls_flags(pem):
    cert, key, ca = pem
    flags = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca]
    flags += ["--allow-insecure-remote"]
    parser = build_parser()
    fl = parser.parse_args([*FL_SERVER, *flags])
    split = parser.parse_args([*SPLIT_SERVE, *flags])
    assert _tls(fl) == _tls(split) == (cert, key, ca, True)
    client = parser.parse_args([*FL_CLIENT, "--tls-ca", ca, "--allow-insecure-remote"])
    assert (client.tls_ca, client.allow_insecure_remote) == (ca, True)
    plain = parser.parse_args(FL_SERVER)
    assert _tls(plain) == (None, None, None, False)


def test_the_old_fl_spellings_still_work_with_a_warning(pem, capsys):
    cert, key, ca = pem
    parser = build_parser()
    old = ["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certfile", ca]
    server = parser.parse_args([*FL_SERVER, *old, "--insecure-remote"])
    assert _tls(server) == (cert, key, ca, True)
    client = parser.parse_args(
        [*FL_CLIENT, "--root-certificates", ca, "--insecure-remote"]
    )
    assert (client.tls_ca, client.allow_insecure_remote) == (ca, True)
    err = capsys.readouterr().err
    assert "--ssl-certfile is now spelled --tls-cert" in err
    assert "--root-certificates is now spelled --tls-ca" in err
    assert "--insecure-remote is now spelled --allow-insecure-remote" in err


@pytest.mark.parametrize("command", [FL_SERVER[:2], FL_CLIENT[:2]])
def test_the_old_spellings_are_hidden_from_help(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    out = capsys.readouterr().out
    assert "--tls-ca" in out and "--allow-insecure-remote" in out
    for old in ("--ssl-", "--root-certificates", "--insecure-remote"):
        assert old not in out


def test_old_spellings_are_checked_like_the_new_ones(tmp_path, capsys):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(SystemExit):
        build_parser().parse_args([*FL_SERVER, "--ssl-certfile", str(garbage)])
    assert "garbage.pem: not a PEM certificate" in capsys.readouterr().err

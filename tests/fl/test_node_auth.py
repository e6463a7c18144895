"""Client authentication with TLS: only SuperNodes with a registered key join."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from aisyn.fl import runtime
from aisyn.fl.node_keys import make_node_keys
from aisyn.net import free_port


def test_keygen_writes_a_key_pair_flower_accepts(tmp_path):
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.cli.supernode.register import try_load_public_key

    keys = make_node_keys(tmp_path, "acme")
    assert try_load_public_key(keys.public)  # what `flwr supernode register` reads
    load_ssh_private_key(keys.private.read_bytes(), None)  # what a SuperNode reads
    assert stat.S_IMODE(keys.private.stat().st_mode) == 0o600


def test_keygen_never_overwrites_a_key(tmp_path):
    make_node_keys(tmp_path, "acme")
    with pytest.raises(FileExistsError, match="acme.key"):
        make_node_keys(tmp_path, "acme")


def test_keygen_command_prints_the_two_paths(tmp_path, capsys):
    import argparse
    import json

    from aisyn.fl import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["fl", "keygen", "--name", "acme", "--out", str(tmp_path)])
    args.func(args)
    out = json.loads(capsys.readouterr().out)
    assert out == {
        "private": str(tmp_path / "acme.key"),
        "public": str(tmp_path / "acme.pub"),
    }


def test_server_with_tls_needs_the_clients_keys(tmp_path):
    from aisyn.fl.launch import serve
    from aisyn.fl.settings import FLSettings

    tls = runtime.ServerTls(tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem")
    with pytest.raises(ValueError, match="--client-key"):
        serve(tmp_path / "base", tmp_path / "out", FLSettings(), tls=tls)


def test_client_with_tls_needs_its_key(tmp_path):
    from aisyn.fl.launch import join

    with pytest.raises(ValueError, match="--auth-key"):
        join(
            "10.0.0.1:9092",
            "acme",
            tmp_path / "data",
            tmp_path / "base",
            tmp_path / "out",
            root_certificates=tmp_path / "ca.pem",
        )


def test_flower_cli_config_gets_an_absolute_certificate_path(tmp_path, monkeypatch):
    """`aisyn fl server --tls-ca certs/ca.pem` (relative): Flower's CLI
    refuses a relative path in its config, so the run (and registering the
    clients' keys) failed."""
    import tomllib

    monkeypatch.chdir(tmp_path)
    runtime.write_connection(tmp_path, "127.0.0.1:9092", Path("certs/ca.pem"))
    config = tomllib.loads((tmp_path / "config.toml").read_text())
    conn = config["superlink"][runtime.CONNECTION]
    assert conn["root-certificates"] == str(tmp_path / "certs" / "ca.pem")


def test_node_auth_without_tls_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs TLS"):
        runtime.start_superlink("127.0.0.1", 1, tmp_path, None, node_auth=True)


def _wait_for(path: Path, texts: list[str], timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = path.read_text(errors="replace") if path.is_file() else ""
        if all(t in log for t in texts):
            return log
        time.sleep(0.5)
    raise AssertionError(f"{path} lacks {texts} after {timeout:.0f} s")


@pytest.mark.heavy
def test_only_a_supernode_with_a_registered_key_is_admitted(tmp_path):
    from aisyn.link import make_dev_certs

    # Prepare: a SuperLink with TLS and node auth; one key registered, one not
    certs = make_dev_certs(tmp_path / "certs")
    tls = runtime.ServerTls(certs.server_cert, certs.server_key, certs.ca_cert)
    registered = make_node_keys(tmp_path / "keys", "registered")
    stranger = make_node_keys(tmp_path / "keys", "stranger")
    port = free_port()
    address = f"127.0.0.1:{port}"
    procs = []
    try:
        link = runtime.start_superlink(
            "127.0.0.1", port, tmp_path / "link", tls, node_auth=True
        )
        procs.append(link)
        runtime.wait_ready(link, address, tls.ca_certfile)
        [node_id] = runtime.register_supernodes(
            address, [registered.public], tmp_path / "register", tls.ca_certfile
        )
        # Execute: both try to connect
        for name, keys in (("registered", registered), ("stranger", stranger)):
            procs.append(
                runtime.start_supernode(
                    address,
                    {"name": name},
                    tmp_path / name,
                    root_certificates=tls.ca_certfile,
                    auth_key=keys.private,
                )
            )
        # Assert: the registered one is activated under its ID, the other refused
        log = _wait_for(
            link.log_path,
            [
                f"Activated node_id={node_id}",
                "No SuperNode found with the given public key",
            ],
        )
        assert log.count("[Fleet.ActivateNode] Activated") == 1
        assert (
            f"SuperNode ID: {node_id}"
            in (tmp_path / "registered" / "supernode.log").read_text()
        )
    finally:
        for p in reversed(procs):
            p.stop()

"""Isolation under faults (issue 21, deliverable 4): four tenants of one
compute centre at once. One trains as it would alone; one's data party is
killed with -9 mid-run and resumes exactly; one sends garbage; one says hello
and stalls. The healthy one's losses equal a solo run's, the garbage and the
stall end only their own sessions, each with its reason, and every lease is
given back."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import CUT, losses, server_settings, train_cfg
from test_faults import cli_env, kill9, wait_for
from test_server_hardening import bad_control, fresh_hello
from test_tenants import Centre, client, fingerprint, subject

from aisyn.link import connect
from aisyn.link.base import LinkOptions
from aisyn.link.certs import TlsConfig, make_dev_certs
from aisyn.link.errors import PeerAbortedError
from aisyn.split import protocol as proto
from aisyn.split.centre.tenants import load_tenants
from aisyn.split.client.train import split_train
from aisyn.split.session import SplitOptions

STEPS, EVERY = 30, 4


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """As the CLI's data party (OMP_NUM_THREADS=1): the same sums in every run."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train_args(cfg_json: Path, data: Path, out: Path, peer) -> list[str]:
    c = train_cfg(steps=STEPS, ckpt_every=EVERY)
    flags = {
        "--model": cfg_json,
        "--data": data,
        "--out": out,
        "--cut": CUT,
        "--steps": c.steps,
        "--batch-size": c.batch_size,
        "--micro-batch-size": c.micro_batch_size,
        "--lr": c.lr,
        "--warmup": c.warmup_steps,
        "--log-every": 1,
        "--seed": c.seed,
        "--ckpt-every": EVERY,
        "--device": "cpu",
        "--mode": "grpc",
        "--peer": peer.address,
        "--tls-cert": peer.tls_cert,
        "--tls-key": peer.tls_key,
        "--tls-ca": peer.tls_ca,
        "--token-file": peer.token_file,
    }
    # held to an undefended solo run
    args = [sys.executable, "-m", "aisyn.cli", "split", "train", "--quiet"]
    args += ["--defence", "none"]
    for flag, value in flags.items():
        args += [flag, str(value)]
    return args


@pytest.mark.heavy
def test_four_tenants_one_healthy_one_killed_one_garbage_one_stalled(
    tmp_path, split_config, news_data, token_file
):
    # Prepare: the tenants, their credentials, the solo run to compare with
    pki = make_dev_certs(tmp_path / "pki", more_clients=["bob", "carol", "dave"])
    (tmp_path / "bob.token").write_text("bob-token-0123456789abcdef")
    (tmp_path / "tenants.toml").write_text(
        f'[tenant.alice]\ncertificate = "{fingerprint(pki.client_cert)}"\n'
        f'[tenant.bob]\ncertificate = "{fingerprint(pki.other_client("bob")[0])}"\n'
        'token_file = "bob.token"\n'
        f'[tenant.carol]\ncertificate = "{fingerprint(pki.other_client("carol")[0])}"\n'
        f'[tenant.dave]\nsubject = "{subject(pki.other_client("dave")[0])}"\n'
    )
    tenants = load_tenants(tmp_path / "tenants.toml")
    cfg_json = tmp_path / "model.json"
    cfg_json.write_text(proto.encode_json(split_config.to_dict()))
    solo = tmp_path / "solo"
    tcfg = train_cfg(steps=STEPS, ckpt_every=EVERY)
    split_train(
        split_config, [news_data], solo, tcfg, SplitOptions(cut=CUT), progress=False
    )
    root = tmp_path / "b"
    listen = server_settings(pki, token_file)
    with Centre(
        split_config, root, listen, tenants, max_sessions=4, hello_timeout_s=2.0
    ) as centre:
        address = centre.server.address
        peers = {
            name: client(pki, address, name, tmp_path / f"{name}.token")
            if name == "bob"
            else client(pki, address, name, token_file)
            for name in ("alice", "bob", "carol", "dave")
        }
        healthy: dict[str, object] = {}

        def alice() -> None:
            opts = SplitOptions(cut=CUT, mode="grpc", peer=peers["alice"])
            try:
                split_train(
                    split_config,
                    [news_data],
                    tmp_path / "alice",
                    tcfg,
                    opts,
                    progress=False,
                )
                healthy["ok"] = True
            except Exception as e:  # reported below
                healthy["ok"] = e

        def open_for(name: str) -> bool:
            return any(t == name for t, _, _ in centre.server.usage.sessions())

        # bob's data party, a process of its own, killed after its first
        # checkpoint; alice starts while bob's session is open
        bob_out = tmp_path / "bob"
        bob = subprocess.Popen(
            train_args(cfg_json, news_data, bob_out, peers["bob"]),
            env=cli_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        runner = threading.Thread(target=alice)
        try:
            deadline = time.monotonic() + 120
            while not open_for("bob"):
                assert bob.poll() is None and time.monotonic() < deadline
                time.sleep(0.01)
            runner.start()
            while not open_for("alice") and runner.is_alive():
                time.sleep(0.005)
            both_at_once = open_for("alice") and open_for("bob")
            wait_for(bob_out / "checkpoints" / "step_00000004" / "state.json", bob)
            kill9(bob)
        finally:
            if bob.poll() is None:
                kill9(bob)

        def raw(name: str):
            p = peers[name]
            return connect(
                address,
                token=Path(p.token_file).read_text().strip(),
                tls=TlsConfig.from_files(p.tls_cert, p.tls_key, p.tls_ca),
                role="A",
                session=proto.encode_json(fresh_hello(split_config, f"{name}-run")),
                options=LinkOptions(keepalive_s=0.5, keepalive_timeout_s=1.0),
                timeout=10,
            )

        # carol: a control tensor with no such op
        carol = raw("carol")
        carol.send("ctl", bad_control(), step=0)
        with pytest.raises(PeerAbortedError, match="op"):
            carol.recv("out", step=0, timeout=10)
        carol.close()
        # dave: a hello, then nothing
        dave = raw("dave")
        t0 = time.monotonic()
        with pytest.raises(PeerAbortedError, match="stopped waiting"):
            dave.recv("out", step=0, timeout=20)
        stalled_for = time.monotonic() - t0
        dave.close()
        runner.join(240)
        # bob resumes, from where its checkpoints are
        opts = SplitOptions(cut=CUT, mode="grpc", peer=peers["bob"])
        split_train(
            split_config, [news_data], bob_out, tcfg, opts, resume=True, progress=False
        )
        deadline = time.monotonic() + 10
        while centre.server.usage.sessions() and time.monotonic() < deadline:
            time.sleep(0.05)
        leases = centre.server.usage.sessions()
    # Assert
    assert both_at_once
    assert healthy == {"ok": True}
    assert losses(tmp_path / "alice") == pytest.approx(losses(solo), rel=1e-6)
    assert losses(bob_out)[-1] == pytest.approx(losses(solo)[-1], rel=1e-6)
    assert stalled_for < 10
    assert leases == []  # every session's hold on its tenant's quota given back
    # runs for the two that trained; the others' folders hold their session
    # records alone
    runs = {p.parent.name for p in root.glob("*/*") if p.is_dir()}
    assert runs == {"alice", "bob"}
    for name in ("carol", "dave"):
        [line] = (root / name / "_sessions.jsonl").read_text().splitlines()
        assert json.loads(line)["outcome"].startswith("failed: ")

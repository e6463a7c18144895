"""A compute centre serving several data owners (issue 21, deliverable 1):
tenants known by their certificate and/or token, each with its own folder
and quotas; one tenant can neither reach another's runs nor pass for it, a
bad tenants file is refused in one line, and a tenant at a quota is told
which, with the numbers, its checkpoints left as they were."""

from __future__ import annotations

import json
import math
import ssl
import threading
import time
from pathlib import Path

import pytest
from conftest import CUT, ServerThread, losses, server_settings, train_cfg
from test_run_owner import snapshot
from test_server_hardening import fresh_hello

from aisyn.link import (
    PeerHello,
    certificate_identity,
    certificate_subject,
    token_identity,
)
from aisyn.link.certs import make_dev_certs
from aisyn.link.errors import HandshakeError, LinkError
from aisyn.model.segments import parse_partition
from aisyn.split.backbone.compute_party import OWNER, ComputeParty
from aisyn.split.backbone.shards import complete_steps
from aisyn.split.centre.server import SplitServer
from aisyn.split.centre.tenants import (
    QuotaError,
    Tenant,
    TenantError,
    Usage,
    load_tenants,
)
from aisyn.split.client.train import split_train
from aisyn.split.session import SplitOptions, open_grpc
from aisyn.split.transport import LinkSettings

BOB_TOKEN = "bob-own-token-0123456789abcdef"
GIB = 2**30
STOLEN = "token presented is tenant bob's but the client certificate is tenant alice's"


def fingerprint(pem: Path) -> str:
    return certificate_identity(ssl.PEM_cert_to_DER_cert(pem.read_text()))


def subject(pem: Path) -> str:
    return certificate_subject(ssl.PEM_cert_to_DER_cert(pem.read_text()))


# --- the tenants file ---------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    (tmp_path / "t.token").write_text("a-token-of-its-own\n")
    (tmp_path / "u.token").write_text("another-token\n")
    return path


CERT = "x509-sha256:" + "ab" * 32
OTHER = "x509-sha256:" + "cd" * 32


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f'[tenant.a]\ncertificate = "{CERT}"\n[tenant.a]\n', "not a valid TOML"),
        (
            f'[tenant.a]\ncertificate = "{CERT}"\n[tenant.b]\ncertificate = "{CERT}"\n',
            "tenants a and b have the same client certificate",
        ),
        (
            '[tenant.a]\ntoken_file = "t.token"\n[tenant.b]\ntoken_file = "t.token"\n',
            "tenants a and b have the same token",
        ),
        (
            '[tenant.a]\nsubject = "CN=x"\n[tenant.b]\nsubject = "CN=x"\n',
            "same certificate subject",
        ),
        (
            f'[tenant.a]\ncertificate = "{CERT}"\ncolour = 1\n',
            r"unknown field\(s\) \['colour'\]",
        ),
        (
            f'[tenant.a]\ncertificate = "{CERT}"\nmax_sessions = 0\n',
            "max_sessions must be a positive whole number, got 0",
        ),
        (
            f'[tenant.a]\ncertificate = "{CERT}"\nmax_sessions = -2\n',
            "max_sessions must be a positive",
        ),
        (
            f'[tenant.a]\ncertificate = "{CERT}"\nmax_sessions = 1.5\n',
            "max_sessions must be a positive whole",
        ),
        (
            f'[tenant.a]\ncertificate = "{CERT}"\nweight = nan\n',
            "weight must be a positive number, got nan",
        ),
        (
            f'[tenant.a]\ncertificate = "{CERT}"\nweight = inf\n',
            "weight must be a positive number, got inf",
        ),
        (
            f'[tenant.a]\ncertificate = "{CERT}"\nweight = "2"\n',
            "weight must be a positive number, got '2'",
        ),
        (
            f'[tenant.a]\ncertificate = "{CERT}"\nsteps_per_hour = true\n',
            "steps_per_hour must be",
        ),
        (
            f'[tenant.a]\ncertificate = "{CERT}"\nmemory = "0GB"\n',
            "memory must be a positive number, got 0.0",
        ),
        (
            f'[tenant.a]\ncertificate = "{CERT}"\nmemory = "lots"\n',
            "memory: memory 'lots'",
        ),
        (
            f'[tenant."../b"]\ncertificate = "{CERT}"\n',
            "tenant '../b': a name is 1-64 letters",
        ),
        (
            f'[tenant.".hidden"]\ncertificate = "{CERT}"\n',
            "tenant '.hidden': a name is",
        ),
        ("[tenant.a]\nweight = 2\n", "nothing identifies it"),
        ('[tenant.a]\ncertificate = "sha1:00"\n', "certificate must be x509-sha256:"),
        ('[tenant.a]\ntoken_file = "missing.token"\n', "token_file .*missing.token"),
        ('[tenant.a]\ncertificate_file = "t.token"\n', "not a PEM certificate"),
        (f'[tenants.a]\ncertificate = "{CERT}"\n', r"unknown table\(s\) \['tenants'\]"),
        ("", r"no \[tenant.NAME\] table"),
    ],
)
def test_a_bad_tenants_file_is_refused_in_one_line(tmp_path, text, message):
    with pytest.raises(TenantError, match=message) as info:
        load_tenants(write(tmp_path, text))
    assert "\n" not in str(info.value)
    assert str(tmp_path / "tenants.toml") in str(info.value)


def test_a_tenants_file_with_every_field(tmp_path):
    tenants = load_tenants(
        write(
            tmp_path,
            f'[tenant.hospital]\ncertificate = "{CERT}"\ntoken_file = "t.token"\n'
            'weight = 2\nmax_sessions = 3\nmemory = "8GB"\nsteps_per_hour = 600\n'
            '[tenant.bank]\nsubject = "CN=bank"\n',
        )
    )
    h = tenants.by_name["hospital"]
    assert (h.certificate, h.weight, h.max_sessions) == (CERT, 2, 3)
    assert h.memory_bytes == 8e9 and h.steps_per_hour == 600
    assert h.token == token_identity("a-token-of-its-own")
    assert "a-token-of-its-own" not in repr(h)  # never in logs
    b = tenants.by_name["bank"]
    assert (b.subject, b.memory_bytes, b.steps_per_hour) == ("CN=bank", math.inf, None)
    assert tenants.token_secrets() == ["a-token-of-its-own"]


# --- who a peer is ------------------------------------------------------------


def peer(identity: str = "", token: str = "shared", subject: str = "") -> PeerHello:
    return PeerHello("A", 1, "{}", identity, token_identity(token), subject)


@pytest.fixture
def two_tenants(tmp_path):
    return load_tenants(
        write(
            tmp_path,
            f'[tenant.alice]\ncertificate = "{CERT}"\n'
            f'[tenant.bob]\ncertificate = "{OTHER}"\ntoken_file = "u.token"\n'
            '[tenant.carol]\ntoken_file = "t.token"\n'
            '[tenant.dave]\nsubject = "CN=dave"\n',
        )
    )


def test_each_tenant_is_found_by_what_its_link_proves(two_tenants):
    assert two_tenants.resolve(peer(CERT)).name == "alice"
    assert two_tenants.resolve(peer(OTHER, "another-token")).name == "bob"
    carol = "token-sha256:" + "0" * 64  # no certificate: named by its token
    assert two_tenants.resolve(peer(carol, "a-token-of-its-own")).name == "carol"
    dave = "x509-sha256:" + "ee" * 32
    assert two_tenants.resolve(peer(dave, subject="CN=dave")).name == "dave"


@pytest.mark.parametrize(
    ("who", "message"),
    [
        # bob's token from alice's certificate: stolen
        (
            peer(CERT, "another-token"),
            STOLEN,
        ),
        # bob's certificate without bob's token
        (peer(OTHER), "tenant bob must present its own token"),
        # carol's token from a certificate nobody owns: carol has none, but
        # the token alone is carol's, and the certificate is no other's
        (
            peer("x509-sha256:" + "11" * 32),
            "no tenant of this compute party owns this client certificate",
        ),
        (
            peer("token-sha256:" + "0" * 64),
            "no tenant of this compute party owns this token",
        ),
        # dave's subject with alice's fingerprint
        (
            peer(CERT, subject="CN=dave"),
            "tenant alice's by its fingerprint and tenant dave's by its subject",
        ),
    ],
)
def test_a_peer_whose_credentials_are_not_one_tenants_is_refused(
    two_tenants, who, message
):
    with pytest.raises(TenantError, match=message):
        two_tenants.resolve(who)


# --- quotas -------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sessions_memory_and_runs_are_counted_per_tenant_and_in_all():
    usage = Usage(max_sessions=4, memory_bytes=10 * GIB, settle_s=0)
    a = Tenant("a", CERT, max_sessions=2, memory_bytes=6 * GIB)
    b = Tenant("b", OTHER, max_sessions=3)
    first = usage.open(a, "r1", 4 * GIB)
    with pytest.raises(QuotaError, match="run r1 has a session open already"):
        usage.open(a, "r1", 1)
    usage.open(b, "r1", 1 * GIB)  # another tenant's r1 is another run
    with pytest.raises(
        QuotaError,
        match=r"tenant a: this session needs 3.00 GiB.* hold 4.00 GiB of its quota of "
        "6.00 GiB",
    ):
        usage.open(a, "r2", 3 * GIB)
    second = usage.open(a, "r2", 1 * GIB)
    with pytest.raises(QuotaError, match="tenant a has 2 session.* its quota is 2"):
        usage.open(a, "r3", 1)
    with pytest.raises(
        QuotaError, match=r"needs 5.00 GiB .* has 4.00 GiB of its 10.00 GiB free"
    ):
        usage.open(b, "r2", 5 * GIB)
    usage.open(b, "r2", 1 * GIB)
    with pytest.raises(
        QuotaError, match=r"serves 4 session\(s\), its most \(--max-sessions 4\)"
    ):
        usage.open(b, "r3", 1)
    first.close()
    first.close()  # twice: no harm
    second.close()
    assert sorted(s[:2] for s in usage.sessions()) == [("b", "r1"), ("b", "r2")]
    usage.open(a, "r1", 4 * GIB)


def test_a_session_is_open_until_its_close_has_been_recorded():
    """Whoever waits for the centre to drain finds every ended session
    recorded (its on_close writes the tenant's _sessions.jsonl line)."""
    usage = Usage(settle_s=0)
    lease = usage.open(Tenant("a", CERT), "r1", 0)
    seen: list[list] = []
    lease.on_close = lambda: seen.append(usage.sessions())
    lease.close()
    assert seen == [[("a", "r1", 0)]] and usage.sessions() == []
    failing = usage.open(Tenant("a", CERT), "r2", 0)
    failing.on_close = lambda: 1 / 0
    with pytest.raises(ZeroDivisionError):
        failing.close()
    assert usage.sessions() == []  # a failed record does not hold the slot


def test_a_session_over_a_quota_waits_briefly_for_one_that_is_ending():
    usage = Usage(max_sessions=1, settle_s=5)
    a = Tenant("a", CERT)
    first = usage.open(a, "r1", 0)
    threading.Timer(0.2, first.close).start()  # the last session, just ending
    usage.open(a, "r1", 0).close()


def test_steps_per_hour_are_a_sliding_hour():
    clock = Clock()
    usage = Usage(clock=clock, settle_s=0)
    lease = usage.open(Tenant("a", CERT, steps_per_hour=2), "r", 0)
    lease.before_step()
    clock.now += 1800
    lease.before_step()
    with pytest.raises(
        QuotaError,
        match="trained 2 steps in the last hour, its quota is 2; the next step is "
        "possible in 1800 s",
    ):
        lease.before_step()
    clock.now += 1800  # the first step is an hour old
    lease.before_step()


# --- over the network ---------------------------------------------------------


class Centre(ServerThread):
    """A compute party serving tenants, several sessions at once."""

    def __init__(
        self, cfg, root: Path, listen: LinkSettings, tenants, init_from=None, **kwargs
    ):
        partition = parse_partition(CUT, cfg)
        party = ComputeParty(cfg, partition, root, device="cpu", init_from=init_from)
        self.party = party
        super().__init__(
            SplitServer(party, listen, tenants=tenants, **kwargs), concurrent=True
        )
        self.server.usage.settle_s = 0.2

    def drained(self, timeout: float = 10) -> None:
        """Wait until B has closed every session (it does so after the data
        party closed its end)."""
        deadline = time.monotonic() + timeout
        while self.server.usage.sessions():
            assert time.monotonic() < deadline, self.server.usage.sessions()
            time.sleep(0.02)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_dev_certs(tmp_path_factory.mktemp("pki"), more_clients=["bob", "eve"])


@pytest.fixture
def centre_files(tmp_path, pki, token_file):
    """alice: her certificate and the shared token; bob: his certificate and
    his own token."""
    (tmp_path / "bob.token").write_text(BOB_TOKEN)
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'[tenant.alice]\ncertificate = "{fingerprint(pki.client_cert)}"\n'
        "max_sessions = 1\n"
        f'[tenant.bob]\nsubject = "{subject(pki.other_client("bob")[0])}"\n'
        'token_file = "bob.token"\nsteps_per_hour = 3\n'
    )
    return load_tenants(path), server_settings(pki, token_file)


def client(pki, address: str, who: str, token: Path) -> LinkSettings:
    cert, key = (
        (pki.client_cert, pki.client_key) if who == "alice" else pki.other_client(who)
    )
    return LinkSettings(
        address,
        tls_cert=str(cert),
        tls_key=str(key),
        tls_ca=str(pki.ca_cert),
        token_file=str(token),
    )


def train(cfg, data, out: Path, peer: LinkSettings, **overrides) -> dict:
    return split_train(
        cfg,
        [data],
        out,
        train_cfg(**overrides),
        SplitOptions(cut=CUT, mode="grpc", window=2, peer=peer),
        progress=False,
    )


@pytest.mark.heavy
def test_two_tenants_train_at_once_each_as_alone_each_in_its_own_folder(
    tmp_path, pki, centre_files, token_file, split_config, news_data, baseline
):
    tenants, listen = centre_files
    root = tmp_path / "b"
    bob_token = tmp_path / "bob.token"
    with Centre(split_config, root, listen, tenants, max_sessions=2) as centre:
        alice = client(pki, centre.server.address, "alice", token_file)
        bob = client(pki, centre.server.address, "bob", bob_token)
        # Execute: the same run id, at the same time (bob within his quota)
        results: dict[str, object] = {}

        def run(name: str, peer: LinkSettings, **kw) -> None:
            try:
                train(split_config, news_data, tmp_path / name, peer, **kw)
                results[name] = "ok"
            except Exception as e:  # reported below
                results[name] = e

        threads = [
            threading.Thread(target=run, args=("alice", alice)),
            threading.Thread(target=run, args=("bob", bob), kwargs={"steps": 3}),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
    # Assert: each trained what it would alone, in a folder of its own
    assert results == {"alice": "ok", "bob": "ok"}
    assert losses(tmp_path / "alice") == pytest.approx(baseline, rel=1e-5)
    assert losses(tmp_path / "bob") == pytest.approx(baseline[:3], rel=1e-5)
    for name in ("alice", "bob"):
        run_id = json.loads((tmp_path / name / "config.json").read_text())["run_id"]
        record = json.loads((root / name / run_id / "config.json").read_text())
        assert record[OWNER] == f"tenant:{name}"
    assert sorted(p.name for p in root.iterdir()) == ["alice", "bob"]


def test_a_tenant_cannot_reach_anothers_run_nor_pass_for_it(
    tmp_path, pki, centre_files, token_file, split_config, news_data
):
    tenants, listen = centre_files
    root = tmp_path / "b"
    with Centre(split_config, root, listen, tenants, max_sessions=2) as centre:
        address = centre.server.address
        alice = client(pki, address, "alice", token_file)
        train(split_config, news_data, tmp_path / "a", alice, steps=2)
        centre.drained()  # B has closed alice's session (and recorded it)
        before = snapshot(root)
        run_id = next(p.name for p in (root / "alice").iterdir() if p.is_dir())
        hello = fresh_hello(split_config, run_id)
        eve = client(pki, address, "eve", token_file)
        stolen = client(pki, address, "alice", tmp_path / "bob.token")
        (tmp_path / "bob.token").write_text(BOB_TOKEN)
        as_bob_without_token = client(pki, address, "bob", token_file)
        for who, message in (
            (eve, "no tenant of this compute party owns this client certificate"),
            (
                stolen,
                STOLEN,
            ),
            (as_bob_without_token, "tenant bob must present its own token"),
        ):
            with pytest.raises(HandshakeError, match=message):
                with open_grpc(who, hello, codec="none", connect_timeout_s=10):
                    pass
        # bob with his own credentials and alice's run id: his own folder,
        # where that run has no checkpoint to resume or evaluate
        bob = client(pki, address, "bob", tmp_path / "bob.token")
        resume = {**hello, "resume": True, "a_steps": [2]}
        with pytest.raises(
            HandshakeError, match="no checkpoint step both parties have"
        ):
            with open_grpc(bob, resume, codec="none", connect_timeout_s=10):
                pass
    # Assert: alice's folder is as it was
    assert {k: v for k, v in snapshot(root).items() if k.startswith("alice")} == before


def test_a_tenant_at_its_quota_is_told_which_and_keeps_its_checkpoints(
    tmp_path, pki, centre_files, token_file, split_config, news_data
):
    tenants, listen = centre_files
    root = tmp_path / "b"
    (tmp_path / "bob.token").write_text(BOB_TOKEN)
    with Centre(split_config, root, listen, tenants, max_sessions=2) as centre:
        address = centre.server.address
        # bob: 3 steps an hour; his 4th step is refused before it starts
        bob = client(pki, address, "bob", tmp_path / "bob.token")
        with pytest.raises(
            LinkError,
            match="tenant bob trained 3 steps in the last hour, its quota is 3",
        ):
            train(split_config, news_data, tmp_path / "bob", bob, steps=6, ckpt_every=2)
        [run] = [p for p in (root / "bob").iterdir() if p.is_dir()]
        assert complete_steps(run / "checkpoints") == [2]  # nothing half-written
        # alice: one session at a time; a second is refused while one is open
        alice = client(pki, address, "alice", token_file)
        with open_grpc(alice, fresh_hello(split_config, "first"), codec="none"):
            with pytest.raises(
                HandshakeError, match="tenant alice has 1 session.* its quota is 1"
            ):
                with open_grpc(
                    alice, fresh_hello(split_config, "second"), codec="none"
                ):
                    pass
        # the first session's end gave its lease back
        with open_grpc(alice, fresh_hello(split_config, "third"), codec="none"):
            pass
    assert centre.server.usage.sessions() == []


def test_serve_refuses_a_bad_tenants_file_before_loading_anything(tmp_path, capsys):
    from aisyn.cli import main

    bad = write(tmp_path, '[tenant."../x"]\ntoken_file = "t.token"\n')
    argv = ["split", "serve", "--listen", "127.0.0.1:0", "--model", "200B"]
    code = main([*argv, "--insecure", "--tenants", str(bad), "--max-sessions", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.startswith("aisyn: error: ") and "tenant '../x': a name is" in err


def test_a_session_is_sized_by_what_it_holds_at_b(
    tmp_path, ft_config, ft_base, token_file
):
    """Full training holds B's weights, gradients and AdamW moments, LoRA over
    the shared base its adapters' (the base is counted once for all); each
    round's activations come on top, sized from the round."""
    from test_finetune import LORA

    from aisyn.model.families import build_model
    from aisyn.model.segments import COMPUTE_PARTY
    from aisyn.split.backbone.compute_party import Session
    from aisyn.train.lora import apply_method

    party = ComputeParty(
        ft_config, parse_partition(CUT, ft_config), tmp_path, init_from=ft_base
    )
    listen = LinkSettings("127.0.0.1:0", token_file=str(token_file), insecure=True)
    server = SplitServer(party, listen, memory_bytes=1e12)
    meta = dict(build_model(ft_config, device="meta").named_parameters())
    weights = 4.0 * sum(meta[n].numel() for n in party.own_parameters)  # fp32
    full = Session("train", "r", train_cfg(), 0)
    assert server.session_bytes(full) == 4 * weights  # weights, grads, 2 moments
    assert server.usage.resident_bytes == 0
    lora = Session("train", "r", train_cfg(), 0, lora=(LORA, {}))
    # the adapters PEFT puts on B's blocks: each, its gradient and 2 moments
    # (fails on the old sizing, which counted a LoRA session as nothing)
    adapted = build_model(ft_config, seed=0)
    within = party.partition.module_paths(COMPUTE_PARTY)
    trainable = apply_method(adapted, LORA, within=within)
    adapters = 4.0 * sum(p.numel() for _, p in trainable)
    assert server.session_bytes(lora) == 4 * adapters > 0
    assert server.usage.resident_bytes == weights  # the base, once
    # a round's activations: more rows, more memory; the window bounds it
    one = server.round_bytes(full, 4, 2, ft_config.seq_len, 0)
    assert 0 < one < server.round_bytes(full, 4, 8, ft_config.seq_len, 0)
    assert server.round_bytes(full, 4, 2, ft_config.seq_len, 3) > one


@pytest.mark.heavy
def test_the_operator_sees_each_tenants_use(
    tmp_path, pki, centre_files, token_file, split_config, news_data, capsys
):
    from aisyn.cli import main

    tenants, listen = centre_files
    root = tmp_path / "b"
    (tmp_path / "bob.token").write_text(BOB_TOKEN)
    with Centre(
        split_config, root, listen, tenants, max_sessions=2,
        metrics_listen="127.0.0.1:0",
    ) as centre:  # fmt: skip
        address = centre.server.address
        alice = client(pki, address, "alice", token_file)
        train(split_config, news_data, tmp_path / "alice", alice, steps=3)
        bob = client(pki, address, "bob", tmp_path / "bob.token")
        with pytest.raises(LinkError, match="its quota is 3"):
            train(split_config, news_data, tmp_path / "bob", bob, steps=4)
        centre.drained()  # B closes bob's session after telling him why
        metrics = f"127.0.0.1:{centre.server.metrics_port}"
        assert main(["split", "status", "--metrics", metrics, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert main(["split", "status", "--metrics", metrics]) == 0
        table = capsys.readouterr().out
    a, b = rows["alice"], rows["bob"]
    tokens = train_cfg().batch_size * split_config.seq_len
    assert (a["steps_total"], a["tokens_total"]) == (3, 3 * tokens)
    assert (b["steps_total"], b["refusals_total"]) == (3, 1)
    assert a["compute_seconds_total"] > 0 and a["sessions"] == b["sessions"] == 0
    assert a["received_bytes_total"] > 0 and a["sent_bytes_total"] > 0
    assert table.splitlines()[0].split()[:3] == ["tenant", "sessions", "steps"]
    [line] = (root / "alice" / "_sessions.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert (record["steps"], record["tokens"], record["outcome"]) == (
        3,
        3 * tokens,
        "ended",
    )
    [line] = (root / "bob" / "_sessions.jsonl").read_text().splitlines()
    assert json.loads(line)["outcome"].startswith("failed: tenant bob trained 3 steps")


def test_a_tenant_named_like_an_old_run_folder_is_refused(
    tmp_path, split_config, two_tenants, token_file
):
    """Runs of a server that had no tenants live in OUT/<run id>: a tenant of
    that name would put its runs inside one of them."""
    root = tmp_path / "b"
    (root / "alice").mkdir(parents=True)
    (root / "alice" / "config.json").write_text("{}")
    party = ComputeParty(split_config, parse_partition(CUT, split_config), root)
    listen = LinkSettings("127.0.0.1:0", token_file=str(token_file), insecure=True)
    with pytest.raises(ValueError, match="b/alice is a run folder, not tenant alice's"):
        SplitServer(party, listen, tenants=two_tenants)


def test_a_round_larger_than_the_memory_quota_allows_is_refused():
    """B learns a run's batch size from its rounds: the lease grows to the
    largest round's, refused with the numbers past the tenant's quota or the
    server's budget, before any of the round's work."""
    usage = Usage(max_sessions=3, memory_bytes=10 * GIB, settle_s=0)
    a = Tenant("a", CERT, max_sessions=2, memory_bytes=4 * GIB)
    lease = usage.open(a, "r1", 1 * GIB)
    lease.round_bytes = lambda m, rows, seq, window: rows * GIB / 2
    lease.fits_round(4, 2, 64, 0)  # 1 GiB fixed + 1 GiB: fits
    assert lease.memory_bytes == 2 * GIB
    lease.fits_round(4, 1, 64, 0)  # smaller: the lease keeps its peak
    assert lease.memory_bytes == 2 * GIB
    other = usage.open(a, "r2", 1 * GIB)
    with pytest.raises(
        QuotaError,
        match=r"tenant a: this round needs 4.00 GiB.*"
        r"other sessions hold 1.00 GiB of its quota of 4.00 GiB",
    ):
        lease.fits_round(4, 6, 64, 0)
    assert lease.memory_bytes == 2 * GIB  # unchanged by the refusal
    other.close()
    b = usage.open(Tenant("b", OTHER, memory_bytes=8 * GIB), "r", 7.5 * GIB)
    with pytest.raises(
        QuotaError,
        match=r"this round needs 3.00 GiB .* has 2.50 GiB of its 10.00 GiB free",
    ):
        lease.fits_round(4, 4, 64, 0)
    b.close()


def test_a_tenant_is_refused_a_round_past_its_memory_quota_over_the_network(
    tmp_path, pki, token_file, split_config, news_data
):
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'[tenant.alice]\ncertificate = "{fingerprint(pki.client_cert)}"\n'
        'memory = "300kB"\n'  # the session's own 267 KiB fit, a round does not
    )
    listen = server_settings(pki, token_file)
    with Centre(split_config, tmp_path / "b", listen, load_tenants(path)) as centre:
        alice = client(pki, centre.server.address, "alice", token_file)
        with pytest.raises(
            LinkError,
            match="tenant alice: this round needs .* of its quota of 292.97 KiB",
        ):
            train(split_config, news_data, tmp_path / "a", alice, steps=2)
        centre.drained()


@pytest.mark.parametrize(
    "page",
    [b"<html><body>a login page</body></html>\n", b"hello world\n", b"\x00\xff\xfe"],
    ids=["html", "text", "binary"],
)
def test_status_of_something_that_is_not_a_metrics_endpoint(page, capsys):
    """``aisyn split status`` pointed at another web server (or a closed port)
    says so in one line."""
    import http.server

    from aisyn.cli import main

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        assert main(["split", "status", "--metrics", address, "--timeout", "5"]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("aisyn: error: http://") and "not a metrics page" in line
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    # nothing listens there any more
    assert main(["split", "status", "--metrics", address, "--timeout", "5"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "cannot read" in line

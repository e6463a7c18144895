"""Opening a session between the data party and a compute party.

``SplitOptions`` say how (a run records them in its config.json), and
``open_session`` opens it whichever way they say:

* ``local``: both parties in this process, joined by an in-memory link; B
  runs its rounds on a thread (the same code a server runs per session).
* ``grpc``: dial a compute party served by ``aisyn split serve``; optionally
  start one on this machine first (``spawn_compute_party``), with fresh dev
  certificates and a random token, and end it by PID afterwards.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from aisyn.link.base import Link
from aisyn.link.errors import CertificateError, LinkError, LinkTimeoutError
from aisyn.link.memory import memory_pair
from aisyn.model.families import ModelConfig, hf_folder
from aisyn.model.segments import Partition
from aisyn.net import join_host_port
from aisyn.procs import ChildProcess, child_env
from aisyn.split import protocol as proto
from aisyn.split.backbone.compute_party import ComputeParty
from aisyn.split.options import MODES, SplitOptions  # noqa: F401 (re-exported)
from aisyn.split.transport import (
    DATA_PARTY_CONNECT_TIMEOUT_S,
    DATA_PARTY_RECV_TIMEOUT_S,
    LinkSettings,
    link_options,
)
from aisyn.train.run import RunDir, write_json_atomic

log = logging.getLogger(__name__)


def failure_reason(exc: BaseException) -> str:
    """The one line the compute party sends the data party when a session
    fails: its reason for a protocol, link or input error, nothing of its
    internals for anything else (a bug: the traceback stays in B's log)."""
    if isinstance(exc, LinkTimeoutError):
        return f"the compute party stopped waiting: {exc}"
    if isinstance(exc, LinkError | ValueError):  # incl. ProtocolError
        return str(exc) or type(exc).__name__
    return "internal error in the compute party (see its log)"


COMPUTE_DIR = "compute"  # in-process compute party's folder inside A's run
SPAWN_DIR = "spawned"  # certificates, token and log of a spawned compute party


@dataclass
class Opened:
    link: Link
    reply: dict
    #: in local mode, the compute party's thread and the error it died of
    thread: threading.Thread | None = None
    errors: list[BaseException] | None = None


@contextlib.contextmanager
def open_local(
    cfg: ModelConfig,
    partition: Partition,
    compute_root: Path,
    hello: dict,
    *,
    codec: str,
    device: str,
    recv_timeout_s: float | None = DATA_PARTY_RECV_TIMEOUT_S,
    init_from: str | Path | None = None,
) -> Iterator[Opened]:
    """Both parties in this process; B's rounds on a thread."""
    party = ComputeParty(
        cfg, partition, compute_root, device=device, init_from=init_from
    )
    link_a, link_b = memory_pair(codec, options=link_options(codec, recv_timeout_s))
    try:
        reply_text, session = party.negotiate(
            proto.encode_json(hello), link_b.peer.identity
        )
        reply = proto.parse_reply(reply_text)
    except BaseException:
        link_a.close()
        link_b.close()
        raise
    errors: list[BaseException] = []

    def run_b() -> None:
        try:
            party.serve_session(link_b, session)
        except BaseException as e:  # reported to A through the link and here
            errors.append(e)
            log.debug("compute party thread failed", exc_info=True)
            link_b.abort(failure_reason(e))
        finally:
            link_b.close()

    thread = threading.Thread(target=run_b, name="compute-party", daemon=True)
    thread.start()
    opened = Opened(link_a, reply, thread, errors)
    try:
        yield opened
    except LinkError as e:
        # B's own exception says more than "peer closed the link".
        link_a.close()
        thread.join(30)
        if errors and not isinstance(errors[0], LinkError):
            raise errors[0] from e
        raise
    finally:
        link_a.close()
        thread.join(30)


@contextlib.contextmanager
def open_grpc(
    settings: LinkSettings,
    hello: dict,
    *,
    codec: str,
    connect_timeout_s: float = DATA_PARTY_CONNECT_TIMEOUT_S,
    recv_timeout_s: float | None = DATA_PARTY_RECV_TIMEOUT_S,
) -> Iterator[Opened]:
    from aisyn.link.grpc_link import connect

    try:
        link = connect(
            settings.address,
            **settings.security(),
            role="A",
            session=proto.encode_json(hello),
            options=link_options(codec, recv_timeout_s),
            timeout=connect_timeout_s,
            data_peer=settings.data_address,
        )
    except CertificateError as e:
        raise CertificateError(
            f"{e}; {certificate_fix(e, settings.server_name)}",
            kind=e.kind,
            hosts=e.hosts,
            dialled=e.dialled,
            port=e.port,
        ) from None
    try:
        try:
            reply = proto.parse_reply(link.peer.session)
        except proto.ProtocolError as e:
            link.abort(f"the data party refused the reply: {e}")
            raise
        yield Opened(link, reply)
    finally:
        link.close()


def certificate_fix(e: CertificateError, server_name: str | None = None) -> str:
    """What the user can do about a certificate that cannot work, in flags
    (``server_name``: the --server-name given, which is the name checked)."""
    if e.kind == "name":
        names = [h for h in e.hosts if "*" not in h]
        if not names:
            dial = None
        elif server_name:
            dial = f"--server-name {names[0]}"
        else:
            dial = f"--peer {join_host_port(names[0], e.port)}"
        remake = f"aisyn certs --host {e.dialled}"
        if dial:
            return (
                f"dial a name it is for ({dial}) or make B's certificate for "
                f"{e.dialled} ({remake})"
            )
        return f"make B's certificate for {e.dialled} ({remake})"
    if e.kind == "untrusted":
        return "give --tls-ca the CA that signed B's certificate"
    if e.kind == "not-yet-valid":
        return "check this machine's clock"
    return "issue current certificates from the CA both parties trust (aisyn certs)"


@dataclass
class SpawnedServer:
    """``aisyn split serve`` started on this machine for one run."""

    proc: ChildProcess
    settings: LinkSettings  # how to reach it

    @property
    def log_path(self) -> Path:
        return self.proc.log_path

    def stop(self) -> None:
        # 15 s: time for a compute party to finish writing a checkpoint
        self.proc.stop(grace_s=15.0)


def spawn_compute_party(
    workdir: Path,
    cfg: ModelConfig,
    partition: Partition,
    compute_root: Path,
    *,
    device: str = "cpu",
    insecure: bool = False,
    start_timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    init_from: str | Path | None = None,
    data_listen: str | None = "127.0.0.1:0",
) -> SpawnedServer:
    """Start a compute party on 127.0.0.1 (free port) and wait until it listens.

    It offers its bulk data plane on ``data_listen`` (None: gRPC alone); on
    loopback nothing stands in its way.

    Unless ``insecure``, it gets a dev CA with server and client certificates
    under ``workdir/certs``, and a random token (file mode 0600). Both are
    made once per run and reused by every later spawn for it (``--resume``,
    eval, generate): the compute party binds the run to the data party's
    identity, which is that certificate (or, plaintext, that token).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    model_json = workdir / "model.json"
    write_json_atomic(model_json, cfg.to_dict())
    token_file = workdir / "token"
    if not (token_file.is_file() and token_file.read_text().strip()):
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
    port_file = workdir / "address"
    port_file.unlink(missing_ok=True)
    args = [
        sys.executable,
        "-m",
        "aisyn.cli",
        "split",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--address-file",
        str(port_file),
        "--model",
        str(model_json),
        "--cut",
        partition.spec,
        "--out",
        str(compute_root),
        "--token-file",
        str(token_file),
        "--device",
        device,
        # Only this process can reach it: runs spawned before runs were bound
        # to their data party are this data party's own.
        "--accept-unbound-runs",
    ]
    if data_listen:
        args += ["--data-listen", data_listen]
    if init_from:
        folder = hf_folder(init_from)
        where = f"hf:{folder.resolve()}" if folder else str(Path(init_from).resolve())
        args += ["--init-from", where]
    if insecure:
        args.append("--insecure")
        tls: dict = {}
    else:
        certs = run_dev_certs(workdir / "certs")
        args += [
            "--tls-cert",
            str(certs.server_cert),
            "--tls-key",
            str(certs.server_key),
            "--tls-ca",
            str(certs.ca_cert),
        ]
        tls = {
            "tls_cert": str(certs.client_cert),
            "tls_key": str(certs.client_key),
            "tls_ca": str(certs.ca_cert),
        }
    proc = ChildProcess(
        "the spawned compute party",
        args,
        workdir / "server.log",
        env=child_env(**(env or {})),
    )
    proc.wait_ready(port_file.is_file, start_timeout_s)
    address = port_file.read_text().strip()
    settings = LinkSettings(
        address, token_file=str(token_file), insecure=insecure, **tls
    )
    log.info("spawned compute party pid %d on %s", proc.pid, address)
    return SpawnedServer(proc, settings)


def run_dev_certs(folder: Path):
    """The dev certificates of a spawned compute party: those already in
    ``folder`` while valid for another day, else new ones (valid 10 years:
    the data party's identity must outlive the run)."""
    from cryptography import x509

    from aisyn.link.certs import DevCerts, make_dev_certs

    certs = DevCerts.at(folder)
    paths = (certs.ca_cert, certs.server_cert, certs.server_key)
    if all(p.is_file() for p in (*paths, certs.client_cert, certs.client_key)):
        soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
        try:
            valid = all(
                x509.load_pem_x509_certificate(p.read_bytes()).not_valid_after_utc
                > soon
                for p in (certs.ca_cert, certs.server_cert, certs.client_cert)
            )
        except ValueError:  # not a certificate any more: make new ones
            valid = False
        if valid:
            return certs
    return make_dev_certs(folder, days=3650)


@contextlib.contextmanager
def open_session(
    run: RunDir,
    mcfg: ModelConfig,
    partition,
    hello: dict,
    opts: SplitOptions,
    device: str,
    init_from: Path | None = None,
):
    """Yields an ``Opened`` session with the compute party, however reached;
    one this process starts (local, spawned) gets ``init_from`` as its base."""
    if opts.mode == "local":
        with open_local(
            mcfg,
            partition,
            run.path / COMPUTE_DIR,
            hello,
            codec=opts.codec,
            device=device,
            recv_timeout_s=opts.recv_timeout_s,
            init_from=init_from,
        ) as opened:
            yield opened
        return
    server = None
    settings = opts.peer
    try:
        if opts.spawn_backbone:
            server = spawn_compute_party(
                run.path / SPAWN_DIR,
                mcfg,
                partition,
                run.path / COMPUTE_DIR,
                device=device,
                insecure=opts.spawn_insecure,
                init_from=init_from,
            )
            settings = server.settings
        assert settings is not None
        with open_grpc(
            settings,
            hello,
            codec=opts.codec,
            connect_timeout_s=opts.connect_timeout_s,
            recv_timeout_s=opts.recv_timeout_s,
        ) as opened:
            yield opened
    finally:
        if server is not None:
            server.stop()

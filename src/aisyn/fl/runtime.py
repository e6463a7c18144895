"""Flower's deployment runtime, driven from ``aisyn fl``: processes and the App.

Why the deployment runtime and not ``flwr.simulation``: in flwr 1.42 the only
simulation backend is Ray, which is not installed here and would add a large,
slow-to-install dependency to CI. The deployment runtime ships with ``flwr``
itself and is what organisations run across machines anyway: one
``flower-superlink`` (server side; Fleet, Control and Runtime APIs on one HTTP
port), one ``flower-supernode`` per organisation, and ``flwr run`` submitting
the App. ``aisyn fl simulate`` starts all of them on loopback; ``aisyn fl
server`` / ``aisyn fl client`` start one side each.

The Flower App is generated: a ``pyproject.toml`` whose components point at
the installed ``aisyn.fl.server_app:app`` / ``aisyn.fl.client_app:app`` and whose
``[tool.flwr.app.config]`` holds this run's settings. Runtime dependency
installation is disabled (``--disable-runtime-dependency-installation``), so
nothing is fetched from a package index. Each process gets ``FLWR_HOME`` under
the run folder (Flower's config and installed Apps stay out of ``~``),
telemetry and update checks are off. Plaintext is refused off loopback: give
TLS files there.

With TLS, clients are authenticated too (Flower's SuperNode authentication): the
SuperLink runs with ``--enable-supernode-auth``, each client's public key is
registered through its Control API (``flwr supernode register``) before the
run, and each SuperNode signs its requests with its private key
(``aisyn.fl.node_keys``). A SuperNode whose key was not registered is refused.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aisyn.fl.node_keys import check_private_key, check_public_key
from aisyn.net import free_port, is_loopback, split_host_port
from aisyn.procs import ChildProcess, child_env

log = logging.getLogger("aisyn.fl.runtime")

APP_NAME = "aisyn-federated"
CONNECTION = "aisyn"
SERVER_APP = "aisyn.fl.server_app:app"
CLIENT_APP = "aisyn.fl.client_app:app"


def app_logging() -> None:
    """The logging of an App process (``server_app``, ``client_app``: Flower
    starts them, not ``aisyn``'s command line): INFO and above, the chatty
    libraries' at WARNING."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s")
    for noisy in ("matplotlib", "PIL", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class RuntimeStartError(OSError):
    """A Flower process could not be started or did not become ready."""


@dataclass
class ServerTls:
    """The SuperLink's certificate, key and the CA that signed it (PEM files)."""

    certfile: Path
    keyfile: Path
    ca_certfile: Path

    def check(self) -> None:
        for p in (self.certfile, self.keyfile, self.ca_certfile):
            if not Path(p).is_file():
                raise FileNotFoundError(f"{p}: TLS file not found")


def check_transport(host: str, tls: object | None, allow_insecure: bool) -> None:
    """Plaintext only on loopback (or when explicitly allowed)."""
    if tls is None and not is_loopback(host) and not allow_insecure:
        raise ValueError(
            f"{host} is not a loopback address: give TLS files (--tls-cert/"
            "--tls-key/--tls-ca on the server, --tls-ca on clients) or pass "
            "--allow-insecure-remote knowingly"
        )


def flower_env(flwr_home: Path) -> dict[str, str]:
    """The environment of a Flower process: its own ``FLWR_HOME``, telemetry off,
    and this interpreter's folder first on ``PATH`` (Flower starts its helper
    processes by name; see ``aisyn.procs``)."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    return child_env(
        FLWR_HOME=str(flwr_home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        PYTHONUNBUFFERED="1",
    )


def executable(name: str) -> str:
    """A Flower entry point next to this interpreter (works in an unactivated venv)."""
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    import shutil

    found = shutil.which(name)
    if found is None:
        raise RuntimeStartError(f"`{name}` not found; is flwr installed?")
    return found


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # TOML basic strings accept JSON's escapes
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def toml_table(name: str, d: dict) -> str:
    lines = [f"[{name}]"] if name else []
    lines += [f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in d.items()]
    return "\n".join(lines) + "\n"


def start_superlink(
    host: str,
    port: int,
    workdir: Path,
    tls: ServerTls | None = None,
    allow_insecure: bool = False,
    node_auth: bool = False,
) -> ChildProcess:
    """The SuperLink; with ``node_auth`` (TLS only: Flower refuses it in
    plaintext) it accepts only SuperNodes registered with ``register_supernodes``.
    """
    check_transport(host, tls, allow_insecure)
    if node_auth and tls is None:
        raise ValueError("SuperNode authentication needs TLS")
    cmd = [
        executable("flower-superlink"),
        "--disable-runtime-dependency-installation",
        "--host",
        host,
        "--port",
        str(port),
    ]
    if tls is None:
        cmd.append("--insecure")
    else:
        tls.check()
        cmd += [
            "--ssl-certfile",
            str(tls.certfile),
            "--ssl-keyfile",
            str(tls.keyfile),
            "--ssl-ca-certfile",
            str(tls.ca_certfile),
        ]
    if node_auth:
        cmd.append("--enable-supernode-auth")
    env = flower_env(workdir / "flwr_home")
    return ChildProcess("superlink", cmd, workdir / "superlink.log", env=env)


def wait_ready(
    proc: ChildProcess,
    address: str,
    root_certificates: Path | None,
    timeout: float = 60.0,
) -> None:
    """Wait until the SuperLink answers on its HTTP health endpoint (a SuperLink
    that exits or is not ready in time is stopped: ``aisyn.procs``)."""
    import httpx

    host, port = split_host_port(address)
    scheme = "https" if root_certificates else "http"
    url = f"{scheme}://{host if ':' not in host else f'[{host}]'}:{port}/health"
    verify = (
        ssl.create_default_context(cafile=str(root_certificates))
        if root_certificates
        else False
    )

    def healthy() -> bool:
        try:
            return httpx.get(url, timeout=1.0, verify=verify).is_success
        except httpx.HTTPError:
            return False

    proc.wait_ready(healthy, timeout, poll_s=0.2)


def write_node_config(path: Path, node_config: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(toml_table("", node_config), encoding="utf-8")
    return path


def start_supernode(
    superlink: str,
    node_config: dict,
    workdir: Path,
    root_certificates: Path | None = None,
    allow_insecure: bool = False,
    threads: int | None = None,
    auth_key: Path | None = None,
) -> ChildProcess:
    """One organisation's SuperNode; ``node_config`` is visible only to its
    ClientApp (data path, base model, run folder). ``threads`` caps the CPU
    threads of its ClientApp processes (several nodes sharing one machine would
    otherwise oversubscribe it, which costs far more than it gains).
    ``auth_key`` is its private key, for a SuperLink with SuperNode
    authentication (TLS only)."""
    host, _ = split_host_port(superlink)
    check_transport(host, root_certificates, allow_insecure)
    config_file = write_node_config(workdir / "node-config.toml", node_config)
    cmd = [
        executable("flower-supernode"),
        "--superlink",
        superlink,
        "--port",
        str(free_port()),  # this node's local Runtime API (for its ClientApps)
        "--node-config",
        str(config_file),
    ]
    if root_certificates is None:
        cmd.append("--insecure")
    else:
        if not Path(root_certificates).is_file():
            raise FileNotFoundError(f"{root_certificates}: CA certificate not found")
        cmd += ["--root-certificates", str(root_certificates)]
    if auth_key is not None:
        if root_certificates is None:
            raise ValueError("SuperNode authentication needs TLS (--tls-ca)")
        private = check_private_key(auth_key).resolve()
        cmd += ["--auth-supernode-private-key", str(private)]
    env = flower_env(workdir / "flwr_home")
    if threads and "OMP_NUM_THREADS" not in os.environ:
        # Inherited by the SuperExec and every ClientApp process it starts.
        env["OMP_NUM_THREADS"] = str(threads)
    return ChildProcess(
        f"supernode {node_config.get('name', '')}",
        cmd,
        workdir / "supernode.log",
        env=env,
    )


def write_app(app_dir: Path, run_config: dict) -> Path:
    """The Flower App folder: just a ``pyproject.toml`` pointing at our apps."""
    from importlib.metadata import version

    app_dir.mkdir(parents=True, exist_ok=True)
    text = (
        toml_table(
            "project",
            {
                "name": APP_NAME,
                "version": version("aisyn"),
                "description": "AIsyn federated fine-tuning of PanGu-alpha",
                "license": "Apache-2.0",
            },
        )
        + "dependencies = []\n\n"
        + toml_table("tool.flwr.app", {"publisher": "aisyn"})
        + "\n"
        + toml_table(
            "tool.flwr.app.components",
            {"serverapp": SERVER_APP, "clientapp": CLIENT_APP},
        )
        + "\n"
        + toml_table("tool.flwr.app.config", run_config)
    )
    (app_dir / "pyproject.toml").write_text(text, encoding="utf-8")
    return app_dir


def write_connection(
    home: Path, superlink: str, root_certificates: Path | None
) -> dict[str, str]:
    """The Flower CLI's config in ``home``: one connection, the default (Flower
    refuses a relative certificate path there); returns the environment of a
    Flower CLI that reads it (``flower_env``, which makes ``home``)."""
    env = flower_env(home)
    conn: dict = {"address": superlink}
    if root_certificates is None:
        conn["insecure"] = True
    else:
        conn["root-certificates"] = str(Path(root_certificates).resolve())
    (home / "config.toml").write_text(
        toml_table("superlink", {"default": CONNECTION})
        + "\n"
        + toml_table(f"superlink.{CONNECTION}", conn),
        encoding="utf-8",
    )
    return env


def register_supernodes(
    superlink: str,
    public_keys: Sequence[Path],
    workdir: Path,
    root_certificates: Path,
) -> list[int]:
    """Register each client's public key with the SuperLink (its Control API);
    returns their node IDs. Only these SuperNodes can then connect."""
    env = write_connection(workdir / "flwr_home", superlink, root_certificates)
    node_ids = []
    for key in public_keys:
        public = check_public_key(key).resolve()
        cmd = [executable("flwr"), "supernode", "register", str(public)]
        proc = subprocess.run(
            [*cmd, CONNECTION, "--format", "json"],
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=120,
        )
        out = proc.stdout
        try:
            reply = json.loads(out[out.index("{") :])
        except ValueError:
            reply = {}
        if proc.returncode or not reply.get("success"):
            why = reply.get("error-message") or (proc.stderr or out)[-300:]
            why = " ".join(str(why).split())  # one line
            raise RuntimeStartError(f"registering client key {key} failed: {why}")
        node_ids.append(int(reply["node-id"]))
    return node_ids


def submit_run(
    app_dir: Path,
    superlink: str,
    workdir: Path,
    root_certificates: Path | None = None,
    timeout: float | None = None,
    echo: bool = False,
) -> int:
    """``flwr run --stream`` the App on the SuperLink; returns its exit status.

    The stream (the ServerApp's log) goes to ``workdir/flwr-run.log`` (and to
    stderr with ``echo``). Past ``timeout`` seconds it is stopped (its whole
    process group) and TimeoutError raised.
    """
    env = write_connection(workdir / "flwr_home", superlink, root_certificates)
    cmd = [executable("flwr"), "run", str(app_dir), CONNECTION, "--stream"]
    log_path = workdir / "flwr-run.log"
    start = log_path.stat().st_size if log_path.exists() else 0
    deadline = None if timeout is None else time.monotonic() + timeout
    run = ChildProcess("flwr run", cmd, log_path, env=env)
    try:
        with log_path.open("rb") as stream:
            stream.seek(start)  # what this run writes, not an earlier one's
            decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
            while True:
                done = not run.alive()
                if echo and (chunk := stream.read()):
                    sys.stderr.write(decode(chunk))
                    sys.stderr.flush()
                if done:
                    return run.wait()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"federated run exceeded {timeout:.0f} s; see {log_path}"
                    )
                time.sleep(0.2)
    finally:
        if run.alive():
            run.stop()

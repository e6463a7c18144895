"""``aisyn fl simulate | server | client``: start the parties and run the federation.

Run folder of ``simulate`` (``server`` / ``client`` write their own part)::

    OUT/server/              global model: config.json, metrics.jsonl (one line per
                             round), loss.png, checkpoints/ (atomic, per round),
                             result.json
    OUT/clients/<name>/      each client's local model after each round, its
                             metrics.jsonl (per step and per round) and loss.png
    OUT/runtime/             Flower's logs, generated App, FLWR_HOME folders
                             (and with TLS node-keys/: the clients' key pairs)
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from aisyn.data.sft import SFTData
from aisyn.errors import RunFailedError
from aisyn.fl import runtime
from aisyn.fl.node_keys import (
    NodeKeys,
    check_private_key,
    check_public_key,
    make_node_keys,
)
from aisyn.fl.round_message import RESULT_FILE
from aisyn.fl.server import ServerNode, server_run_config
from aisyn.fl.settings import FLSettings
from aisyn.net import free_port
from aisyn.procs import ChildProcess
from aisyn.train.models import check_data_matches, describe_base

log = logging.getLogger("aisyn.fl")


class FederatedRunError(RunFailedError):
    """The federated run ended without a result (see the logs it names)."""


def check_client(name: str, data: Path, base: Path, role: str = "client") -> None:
    """Fail early, with the client's name, on missing or mismatched data
    (``role``: what the message calls it)."""
    info = describe_base(base)
    try:
        sft = SFTData.open(data, "train")
        check_data_matches(info, [sft])
    except ValueError as e:
        raise ValueError(f"{role} {name}: {e}") from None


def check_chunking(base: Path, settings: FLSettings) -> int:
    """The chunks of this base model's trainable tensors under
    ``max-message-mb`` (1: one message); refuses, before any process starts,
    settings that cannot run chunked (``aisyn.fl.chunks``). The model is built
    on the meta device."""
    info = describe_base(base)
    if not settings.max_message_mb:
        return 1
    import torch

    from aisyn.fl.chunks import plan_for
    from aisyn.model.families import build_model
    from aisyn.train.lora import apply_method

    with torch.device("meta"):
        model = build_model(info.model)
        trainable = apply_method(model, settings.method_spec(), settings.train.seed)
    plan = plan_for(settings, {n: tuple(p.shape) for n, p in trainable})
    return len(plan) if plan else 1


def _key_name(client: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", client).lstrip(".") or "client"


def largest_client(clients: Mapping[str, str | Path]) -> int:
    """The most training items any of ``clients`` holds (0: none readable)."""
    sizes = []
    for data in clients.values():
        try:
            sizes.append(len(SFTData.open(Path(data), "train", verify=False)))
        except (ValueError, OSError):
            continue  # a client without data fails its rounds (validate=False)
    return max(sizes, default=0)


def _check_fresh(path: Path, resume: bool = False) -> None:
    """A fresh run needs a fresh server folder; ``resume`` one that holds a run."""
    held = (path / "config.json").exists()
    if held and not resume:
        raise FileExistsError(
            f"{path}: already holds a run; pass --resume to continue it "
            "or choose another --out"
        )
    if resume and not held:
        raise FileNotFoundError(f"--resume: {path} holds no federated run")


def _result(server_out: Path, log_path: Path, rc: int) -> dict:
    result_file = server_out / RESULT_FILE
    if result_file.is_file():
        return json.loads(result_file.read_text())
    # the last exception line of a traceback, e.g. "pkg.SomeError: what happened"
    exc = re.compile(r"^[\w.]*(Error|Exception|Rejected|Exit)\w*: .+")
    lines = []
    if log_path.is_file():
        lines = [
            ln.strip()
            for ln in log_path.read_text(errors="replace").splitlines()
            if exc.match(ln.strip())
        ]
    hint = lines[-1] if lines else f"flwr run exited with {rc}"
    raise FederatedRunError(f"federated run failed ({hint}); see {log_path}")


def run_server_side(
    base: Path,
    out: Path,
    settings: FLSettings,
    superlink: ChildProcess,
    address: str,
    root_certificates: Path | None,
    echo: bool,
    chunks: int = 1,
    resume: bool = False,
) -> dict:
    runtime_dir = out / "runtime"
    app = runtime.write_app(
        runtime_dir / "app",
        server_run_config(settings, ServerNode(base, out / "server", resume)),
    )
    # each exchange waits at most round-timeout: a round's train and evaluate
    # messages, and in a chunked run each chunk both ways
    exchanges = 2 if chunks == 1 else 2 * chunks + 2
    timeout = settings.rounds * exchanges * settings.round_timeout + 600
    rc = runtime.submit_run(
        app,
        address,
        runtime_dir / "submit",
        root_certificates=root_certificates,
        timeout=timeout,
        echo=echo,
    )
    if not superlink.alive():
        raise FederatedRunError(f"the SuperLink died: {superlink.tail()}")
    return _result(out / "server", runtime_dir / "submit" / "flwr-run.log", rc)


def simulate(
    base: str | Path,
    clients: Mapping[str, str | Path],
    out: str | Path,
    settings: FLSettings,
    *,
    echo: bool = False,
    validate: bool = True,
    tls: runtime.ServerTls | None = None,
    client_ranks: int = 1,
    resume: bool = False,
) -> dict:
    """All parties on this machine (loopback), each in its own processes;
    ``resume``: continue the run in ``out`` from its last finished round.

    ``client_ranks``: every client trains its local steps on that many
    data-parallel ranks (``aisyn.fl.ranks``).

    With ``tls`` the SuperLink serves HTTPS and clients verify it with the CA
    (as across machines), and each client gets a fresh key pair that is
    registered with the SuperLink (SuperNode authentication). ``validate=False``
    skips the up-front check of the clients' data (tests use it to put a failing
    party into a run).
    """
    base, out = Path(base).resolve(), Path(out).resolve()
    if len(clients) < settings.min_clients:
        raise ValueError(
            f"{len(clients)} client(s) given but min-clients is {settings.min_clients}"
        )
    if validate:
        for name, data in clients.items():
            check_client(name, Path(data), base)
    chunks = check_chunking(base, settings)
    if settings.train.batch_size % client_ranks:
        raise ValueError(
            f"--batch-size {settings.train.batch_size} does not split into "
            f"--client-ranks {client_ranks}"
        )
    if settings.max_examples == 0:
        # Here the server knows every client's data: a reply's num-examples counts
        # at most the largest client's items, so honest weights stay exact and a
        # client lying about its size gains at most the largest honest weight.
        settings = replace(settings, max_examples=largest_client(clients))
    _check_fresh(out / "server", resume)
    threads = max(1, (os.cpu_count() or 1) // (len(clients) * client_ranks))
    t0 = time.perf_counter()
    procs: list[ChildProcess] = []
    try:
        port = free_port()
        address = f"127.0.0.1:{port}"
        superlink = runtime.start_superlink(
            "127.0.0.1", port, out / "runtime" / "superlink", tls, node_auth=bool(tls)
        )
        procs.append(superlink)
        ca = tls.ca_certfile if tls else None
        runtime.wait_ready(superlink, address, ca)
        keys: dict[str, NodeKeys] = {}
        if tls is not None:
            keys = {
                name: make_node_keys(out / "runtime" / "node-keys", _key_name(name))
                for name in clients
            }
            runtime.register_supernodes(
                address,
                [k.public for k in keys.values()],
                out / "runtime" / "register",
                tls.ca_certfile,
            )
        for name, data in clients.items():
            procs.append(
                runtime.start_supernode(
                    address,
                    {
                        "name": name,
                        "data": str(Path(data).resolve()),
                        "base": str(base),
                        "out": str(out / "clients" / name),
                        "ranks": client_ranks,
                    },
                    out / "runtime" / f"client-{name}",
                    root_certificates=ca,
                    threads=threads,
                    auth_key=keys[name].private if keys else None,
                )
            )
        result = run_server_side(
            base, out, settings, superlink, address, ca, echo, chunks, resume
        )
    finally:
        for p in reversed(procs):
            p.stop()
    result["wall_s"] = time.perf_counter() - t0
    result["clients"] = {n: str(out / "clients" / n) for n in clients}
    return result


def serve(
    base: str | Path,
    out: str | Path,
    settings: FLSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 9092,
    tls: runtime.ServerTls | None = None,
    allow_insecure: bool = False,
    echo: bool = True,
    client_keys: Sequence[str | Path] = (),
    resume: bool = False,
) -> dict:
    """The server side: a SuperLink, then the run once ``min-clients`` joined.

    With ``tls`` only clients whose public key is in ``client_keys`` can join
    (SuperNode authentication)."""
    base, out = Path(base).resolve(), Path(out).resolve()
    if tls is not None and not client_keys:
        raise ValueError(
            "with TLS the server admits only registered clients: give each "
            "client's public key (--client-key NAME.pub; `aisyn fl keygen` makes them)"
        )
    if tls is None and client_keys:
        raise ValueError(
            "client keys need TLS (SuperNode authentication runs over TLS)"
        )
    keys = [check_public_key(k) for k in client_keys]
    chunks = check_chunking(base, settings)
    _check_fresh(out / "server", resume)
    superlink = runtime.start_superlink(
        host, port, out / "runtime" / "superlink", tls, allow_insecure, bool(tls)
    )
    try:
        local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        address = f"{local}:{port}" if ":" not in local else f"[{local}]:{port}"
        ca = tls.ca_certfile if tls else None
        runtime.wait_ready(superlink, address, ca)
        if tls is not None:
            ids = runtime.register_supernodes(
                address, keys, out / "runtime" / "register", tls.ca_certfile
            )
            log.info("registered %d client key(s): node IDs %s", len(ids), ids)
        log.info(
            "SuperLink listening on %s:%d; waiting for %d client(s)",
            host,
            port,
            settings.min_clients,
        )
        return run_server_side(
            base, out, settings, superlink, address, ca, echo, chunks, resume
        )
    finally:
        superlink.stop()


def join(
    superlink: str,
    name: str,
    data: str | Path,
    base: str | Path,
    out: str | Path,
    *,
    root_certificates: Path | None = None,
    allow_insecure: bool = False,
    auth_key: str | Path | None = None,
    client_ranks: int = 1,
) -> int:
    """One organisation's client: a SuperNode serving ClientApp runs until stopped.

    With TLS it authenticates with ``auth_key`` (its private key; the server
    registered the public one)."""
    data, base, out = Path(data).resolve(), Path(base).resolve(), Path(out).resolve()
    if root_certificates is not None and auth_key is None:
        raise ValueError(
            "with TLS the server admits only registered clients: give --auth-key "
            "(this client's private key from `aisyn fl keygen`; the server "
            "registers its .pub)"
        )
    if auth_key is not None:
        check_private_key(auth_key)
    check_client(name, data, base)
    node = runtime.start_supernode(
        superlink,
        {
            "name": name,
            "data": str(data),
            "base": str(base),
            "out": str(out),
            "ranks": client_ranks,
        },
        out.parent / f".{out.name}-runtime",
        root_certificates,
        allow_insecure,
        auth_key=Path(auth_key) if auth_key is not None else None,
    )
    log.info(
        "client %s connected to %s (logs: %s); Ctrl-C to stop",
        name,
        superlink,
        node.log_path,
    )
    try:
        return node.wait()
    finally:
        node.stop()

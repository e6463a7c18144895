"""The compute party's commands: ``aisyn split serve`` (one data party, or
a centre serving many) and ``aisyn split status`` (each tenant's use)."""

from __future__ import annotations

import argparse
import json
import logging
import math

from aisyn import procs, validate
from aisyn.flagtable import (
    DEVICE,
    REQUIRED,
    add_command,
    add_config_flag,
    add_flags,
    init_from_flag,
    model_flag,
)
from aisyn.setting import flag_rows, from_args
from aisyn.split.centre.options import ServeOptions
from aisyn.split.flags import (
    DEFAULT_CUT,
    add_link_args,
    link_settings,
    memory_size,
)
from aisyn.split.transport import (
    COMPUTE_PARTY_IDLE_TIMEOUT_S,
    link_options,
)
from aisyn.tls_flags import add_tls_files
from aisyn.validate import (
    positive_float,
)

log = logging.getLogger("aisyn.split")


def _metrics_tls(args):
    """--metrics-tls-cert/-key/-ca: all three (the endpoint asks every scraper
    for a client certificate), and only with --metrics-listen."""
    from aisyn.split.centre.metrics_endpoint import MetricsTls

    given = {
        flag: value
        for flag, value in (
            ("--metrics-tls-cert", args.metrics_tls_cert),
            ("--metrics-tls-key", args.metrics_tls_key),
            ("--metrics-tls-ca", args.metrics_tls_ca),
        )
        if value
    }
    if not given:
        return None
    if args.metrics_listen is None:
        raise ValueError(
            f"{', '.join(given)}: there is no --metrics-listen endpoint to secure"
        )
    if len(given) < 3:
        raise ValueError(
            "--metrics-tls-cert, --metrics-tls-key and --metrics-tls-ca go "
            "together (the endpoint's certificate and key, and the CA of its "
            f"scrapers' client certificates); only {', '.join(given)} given"
        )
    return MetricsTls(args.metrics_tls_cert, args.metrics_tls_key, args.metrics_tls_ca)


def cmd_serve(args) -> None:
    """Holds only the middle blocks of --model cut by --cut; takes the
    optimisation settings from each data party's hello; keeps one run folder per
    data-party run under --out. Serves --max-sessions sessions at once (one by
    default) and stays up when a session fails. With --tenants each data owner
    is a tenant: its runs under --out/TENANT, its own quotas. Under torchrun
    the blocks spread over the ranks: pipeline stages, or FSDP2 shards with
    more ranks than blocks (rank 0 alone listens; docs/split.md)."""

    from aisyn.model.families import hf_folder, load_config
    from aisyn.model.segments import parse_partition
    from aisyn.split.backbone.compute_party import ComputeParty
    from aisyn.split.backbone.ranks import Ranks, serve_ranks
    from aisyn.split.centre.server import SplitServer, return_large_blocks_to_os
    from aisyn.train import distributed
    from aisyn.train.device import resolve_device

    metrics_tls = _metrics_tls(args)  # checked before anything is loaded
    opts = from_args(ServeOptions, args)
    # Before any session's thread allocates: what a session frees goes back
    # to the OS, not into its thread's arena (a centre holds many sessions).
    return_large_blocks_to_os()
    tenants = None
    if args.tenants:  # checked before anything is loaded
        from aisyn.split.centre.tenants import load_tenants

        tenants = load_tenants(args.tenants)
        log.info("serving %d tenant(s): %s", len(tenants), ", ".join(tenants.by_name))
    cfg = load_config(args.model)
    partition = parse_partition(args.cut, cfg)
    device, ranks = args.device, None
    if distributed.under_torchrun():
        procs.end_with_parent()  # a rank never outlives its torchrun agent
    if distributed.world_size() > 1:
        # torchrun: B's blocks as pipeline stages over the ranks (rank 0
        # alone listens); every wait between ranks is bounded by the idle
        # timeout, as the wait for the data party is.
        timeout = opts.idle_timeout or COMPUTE_PARTY_IDLE_TIMEOUT_S
        ranks, device = Ranks.join(cfg, partition, resolve_device(device), timeout)
        ranks.check_shared(args.out, "compute party")
    # A pretrained folder (hf:DIR) is also where B's blocks start from.
    init_from = args.init_from or (args.model if hf_folder(args.model) else None)
    party = ComputeParty(
        cfg,
        partition,
        args.out,
        device=str(device),
        keep_checkpoints=opts.keep_checkpoints,
        init_from=init_from,
        accept_unbound=opts.accept_unbound_runs,
    )
    party.ranks = ranks
    party.batch_tenants = opts.batch_tenants
    if ranks is not None and ranks.rank != 0:
        serve_ranks(party)
        return
    options = link_options(recv_timeout_s=opts.idle_timeout)
    server = SplitServer(
        party,
        link_settings(args, args.listen),
        options,
        opts.hello_timeout,
        tenants=tenants,
        max_sessions=opts.max_sessions,
        memory_bytes=math.inf if args.memory is None else args.memory,
        metrics_listen=args.metrics_listen,
        metrics_tls=metrics_tls,
    )
    server.start(args.address_file)
    stages = "" if ranks is None else f" (blocks over {ranks.world} ranks)"
    print(f"compute party listening on {server.address}{stages}", flush=True)
    try:
        server.serve_forever(opts.exit_after)
    finally:
        server.stop()


def _status_tls(args):
    """The TLS context of ``split status`` against an endpoint served with
    --metrics-tls-*: all three files, or none (plain HTTP)."""
    import ssl

    files = (args.tls_cert, args.tls_key, args.tls_ca)
    if not any(files):
        return None
    if not all(files):
        raise ValueError(
            "--tls-cert, --tls-key and --tls-ca go together: a client "
            "certificate and key the endpoint's --metrics-tls-ca signed, and the "
            "CA of its own certificate"
        )
    context = ssl.create_default_context(cafile=args.tls_ca)
    context.load_cert_chain(args.tls_cert, args.tls_key)
    return context


def cmd_status(args) -> None:
    """Each tenant's use of a running compute party, from its metrics
    endpoint (`aisyn split serve --metrics-listen HOST:PORT`): sessions open,
    steps, tokens, compute seconds, bytes each way, memory held, seconds
    queued and refusals."""
    import urllib.error
    import urllib.request

    from aisyn.split.centre.tenant_metrics import format_status, read_status

    context = _status_tls(args)
    url = f"{'https' if context else 'http'}://{args.metrics}/metrics"
    try:
        with urllib.request.urlopen(
            url, timeout=args.timeout, context=context
        ) as reply:
            text = reply.read(16 << 20).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ConnectionError(f"cannot read {url}: {reason}") from None
    try:
        rows = read_status(text)
    except ValueError as e:
        raise ValueError(f"{url}: not a metrics page: {e}") from None
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    elif rows:
        print(format_status(rows))
    else:
        print(f"no tenant has opened a session on {args.metrics} yet")


def _add_serve(ssub: argparse._SubParsersAction) -> None:
    v = add_command(ssub, "serve", cmd_serve, "serve as the compute party over gRPC")
    add_flags(
        v,
        ("--listen", validate.listen_address, REQUIRED, "HOST:PORT (port 0: any free)"),
        model_flag(REQUIRED),
        ("--cut", None, DEFAULT_CUT, "u:FRONT,BACK (as the data party's)"),
        ("--out", None, None, "checkpoint root (none: cannot checkpoint)"),
        DEVICE,
        init_from_flag(
            "; it must hold the whole model: B loads only its tensors, and "
            "refuses a data party that starts from another base"
        ),
        ("--address-file", None, None, "write the bound HOST:PORT here once listening"),
        (
            "--memory",
            memory_size,
            None,
            "what the open sessions may hold at B in all, as the planner "
            "estimates each (e.g. 64GB); a session over it is refused with the "
            "numbers",
        ),
        (
            "--tenants",
            None,
            None,
            "TOML file of the data owners served (docs/split.md#tenants): each "
            "its own certificate and/or token, folder under --out and quotas",
        ),
        (
            "--metrics-listen",
            validate.listen_address,
            None,
            "HOST:PORT of a Prometheus endpoint with each tenant's steps, "
            "tokens, compute seconds, bytes, sessions, memory, queue wait and "
            "refusals (plain HTTP unless --metrics-tls-*: keep it on loopback "
            "or an operators' network; `aisyn split status --metrics HOST:PORT` "
            "reads it)",
        ),
    )
    add_flags(v, *flag_rows(ServeOptions))
    add_link_args(v, server=True)
    add_tls_files(
        v.add_argument_group("metrics endpoint security"),
        cert="serve --metrics-listen over HTTPS with this certificate (PEM)",
        key="its private key (PEM)",
        ca="CA (PEM) that must have signed every scraper's client certificate "
        "(best one of its own: whatever it signed reads every tenant's use)",
        prefix="metrics-",
    )
    add_config_flag(v, "split-serve")


def _add_status(ssub: argparse._SubParsersAction) -> None:
    st = add_command(ssub, "status", cmd_status, "each tenant's use of a compute party")
    add_flags(
        st,
        (
            "--metrics",
            validate.listen_address,
            REQUIRED,
            "HOST:PORT of --metrics-listen",
        ),
        ("--timeout", positive_float, 10.0, "seconds to wait for the endpoint"),
        ("--json", "store_true", None, "print the figures as JSON"),
    )
    add_tls_files(
        st.add_argument_group("an endpoint served with --metrics-tls-*"),
        cert="client certificate (PEM) signed by the endpoint's --metrics-tls-ca",
        key="its private key (PEM)",
        ca="CA certificate (PEM) that signed the endpoint's",
    )


def register(ssub: argparse._SubParsersAction) -> None:
    """Add the compute party's commands to ``aisyn split``."""
    for add in (
        _add_serve,
        _add_status,
    ):
        add(ssub)

"""The flags every ``aisyn split`` command shares: the link's security
(mutual TLS, token, plaintext on loopback), its timeouts, the default cut."""

from __future__ import annotations

import argparse

from aisyn import validate
from aisyn.split.options import SplitOptions
from aisyn.split.transport import parse_timeout
from aisyn.tls_flags import add_allow_insecure_remote, add_tls_files

#: the cut both parties take when not told (the data party's, declared there)
DEFAULT_CUT = SplitOptions.cut


def add_link_args(p: argparse.ArgumentParser, *, server: bool) -> None:
    """The link's flags: mutual TLS files, token, plaintext on loopback; a
    data party's server name and data-plane address, or a server's."""
    g = p.add_argument_group("link security")
    add_tls_files(
        g,
        cert="this party's certificate (PEM) for mutual TLS",
        key="this party's private key (PEM)",
        ca="CA certificate (PEM) that signed the peer's",
    )
    if not server:
        g.add_argument(
            "--server-name",
            help="name to verify in the server certificate when it differs from "
            "the --peer host",
        )
        g.add_argument(
            "--data-peer",
            type=validate.host_port,
            help="dial the compute party's data plane (when it offers one) at this "
            "HOST:PORT instead of the --peer host and the port it names: for a "
            "proxy or NAT between the parties",
        )
    else:
        g.add_argument(
            "--data-listen",
            type=validate.listen_address,
            help="also offer every session a bulk data plane on HOST:PORT (port 0: "
            "any free): its tensors then travel on two mutual-TLS connections "
            "beside the gRPC stream, near a plain TLS socket's rate; the data "
            "party's firewall must let it reach this port too",
        )
    g.add_argument(
        "--token-file",
        help="file holding the shared token (default: $AISYN_SPLIT_TOKEN)",
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext, no TLS (refused on non-loopback addresses unless "
        "--allow-insecure-remote)",
    )
    add_allow_insecure_remote(
        g, "permit --insecure on a non-loopback address (activations leak data!)"
    )


def timeout_type(text: str) -> float | None:
    """A timeout flag (--recv-timeout, --idle-timeout, --hello-timeout):
    seconds, or 0 / none to wait forever."""
    try:
        return parse_timeout(text)
    except ValueError as e:  # argparse prints only this kind's message
        raise argparse.ArgumentTypeError(str(e)) from None


def link_settings(args, address: str):
    from aisyn.split.transport import LinkSettings

    return LinkSettings(
        address,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        server_name=getattr(args, "server_name", None),
        token_file=args.token_file,
        insecure=args.insecure,
        allow_insecure_remote=args.allow_insecure_remote,
        data_address=getattr(args, "data_listen", None)
        or getattr(args, "data_peer", None),
    )


def memory_size(text: str) -> float:
    from aisyn.model.cost import PlanError, parse_bytes

    try:
        value = parse_bytes(text)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: must be a size above 0 (leave the flag out for no budget)"
        )
    return value

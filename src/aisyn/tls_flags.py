"""The TLS flags of every command that talks over a network: one vocabulary.

``aisyn split`` and ``aisyn fl`` both take ``--tls-cert``, ``--tls-key`` and
``--tls-ca`` (PEM files, checked while parsing) and ``--allow-insecure-remote``
(plaintext off loopback, knowingly). The federated commands' earlier spellings
(``--ssl-certfile``, ``--ssl-keyfile``, ``--ssl-ca-certfile``,
``--root-certificates``, ``--insecure-remote``) still work for one release:
hidden from ``--help``, same destination, a warning when used.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from aisyn import validate

#: each TLS file flag's argparse type
_FILES = {
    "--tls-cert": validate.pem_certificates,
    "--tls-key": validate.pem_private_key,
    "--tls-ca": validate.pem_certificates,
}
ALLOW_INSECURE_REMOTE = "--allow-insecure-remote"


class _OldSpelling(argparse.Action):
    """An earlier spelling of ``new``: stores into its destination, and says so."""

    def __init__(self, option_strings, dest, *, new: str, **kwargs) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(
            f"aisyn: warning: {option_string} is now spelled {self.new}; the old "
            "spelling goes away in the next release",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def add_tls_files(
    group: argparse._ActionsContainer,
    *,
    cert: str | None,
    key: str | None,
    ca: str,
    old: Mapping[str, str] | None = None,
    prefix: str = "",
) -> None:
    """``--tls-cert``, ``--tls-key`` and ``--tls-ca`` with these helps (a flag
    whose help is None is left out); ``old`` maps a flag to an earlier spelling
    accepted as a hidden alias. A ``prefix`` names another endpoint's set
    (``metrics-``: ``--metrics-tls-cert``, ...), checked alike."""
    for flag, help_text in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
        if help_text is None:
            continue
        group.add_argument(
            "--" + prefix + flag.removeprefix("--"),
            type=_FILES[flag],
            default=None,
            help=help_text,
        )
        if old and flag in old:
            group.add_argument(
                old[flag],
                type=_FILES[flag],
                dest=_dest(flag),
                default=None,
                action=_OldSpelling,
                new=flag,
                help=argparse.SUPPRESS,
            )


def add_allow_insecure_remote(
    group: argparse._ActionsContainer, help_text: str, *, old: str | None = None
) -> None:
    """``--allow-insecure-remote`` (and a hidden earlier spelling ``old``)."""
    group.add_argument(ALLOW_INSECURE_REMOTE, action="store_true", help=help_text)
    if old:
        group.add_argument(
            old,
            dest=_dest(ALLOW_INSECURE_REMOTE),
            nargs=0,
            default=False,
            action=_OldSpelling,
            new=ALLOW_INSECURE_REMOTE,
            help=argparse.SUPPRESS,
        )

"""How ``aisyn split serve`` serves, each option declared once (``aisyn.setting``):
its flags, their defaults and ranges come from ``ServeOptions``."""

from __future__ import annotations

from dataclasses import dataclass

from aisyn.setting import check_fields, setting
from aisyn.split.flags import timeout_type
from aisyn.split.transport import (
    COMPUTE_PARTY_HELLO_TIMEOUT_S,
    COMPUTE_PARTY_IDLE_TIMEOUT_S,
)


@dataclass(frozen=True)
class ServeOptions:
    """The compute party's serving options (its model, cut, folders and
    addresses are the command's own flags)."""

    keep_checkpoints: int = setting(
        2, "--keep-checkpoints", "checkpoints kept per run", low=1
    )
    max_sessions: int = setting(
        1,
        "--max-sessions",
        "sessions served at once, each on a thread of its own; more callers "
        "are told the server is busy and queued",
        low=1,
    )
    exit_after: int | None = setting(
        None,
        "--exit-after",
        "exit after this many sessions (default: serve forever)",
        low=1,
    )
    batch_tenants: bool = setting(
        False,
        "--batch-tenants",
        "LoRA sessions over the shared --init-from base run the micro-batches "
        "that wait at once through it together, each row with its own "
        "adapters (one forward and backward for all)",
    )
    accept_unbound_runs: bool = setting(
        False,
        "--accept-unbound-runs",
        "let any data party continue a run bound to none over the network "
        "(made before runs were bound to their data party, or in-process by "
        "--mode local): for a compute party no one else can reach, as "
        "--spawn-backbone starts",
    )
    #: None: forever (its flag takes 0 or none for it)
    idle_timeout: float | None = setting(
        COMPUTE_PARTY_IDLE_TIMEOUT_S,
        "--idle-timeout",
        "seconds: end a session whose data party, still connected, sends "
        "nothing for this long, e.g. between steps while it writes its "
        "checkpoints or evaluates, so it cannot hold the server (0 or none: "
        "wait forever)",
        check=False,
        parse=timeout_type,
    )
    hello_timeout: float | None = setting(
        COMPUTE_PARTY_HELLO_TIMEOUT_S,
        "--hello-timeout",
        "seconds: end a session whose data party sends no round this long "
        "after its hello, so that a silent one holds the server briefly while "
        "others queue (raise it if the data party takes longer to load its "
        "checkpoint; 0 or none: the idle timeout)",
        check=False,
        parse=timeout_type,
    )

    def __post_init__(self) -> None:
        check_fields(self)

"""``SplitOptions``: how the data party trains against B, each option declared
once (``aisyn.setting``). Light on purpose: every ``aisyn`` command's parser
builds ``aisyn split train``'s flags from it, and the session machinery it
configures (``split.session``, the compute party, torch's pipelining) is
imported only when a session opens."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from aisyn.link.codec import CODECS
from aisyn.setting import check_fields, setting
from aisyn.split import protocol as proto
from aisyn.split.defence.emulator import DEFAULT_BLOCKS, FRONT_VIA
from aisyn.split.transport import (
    DATA_PARTY_CONNECT_TIMEOUT_S,
    DATA_PARTY_RECV_TIMEOUT_S,
    LinkSettings,
)

MODES = ("local", "grpc")


@dataclass
class SplitOptions:
    """How the data party trains against B, each option declared once
    (``aisyn.setting``): the flags of ``aisyn split train`` and the checks of
    a recorded run's options."""

    cut: str = setting("u:1,1", "--cut", "u:FRONT,BACK blocks kept by A (see plan)")
    mode: str = setting(
        "local", "--mode", "local: both parties in this process", choices=MODES
    )
    window: int = setting(
        0, "--pipeline", "micro-batches in flight (1F1B); 0: lockstep", low=0
    )
    codec: str = setting(
        "none",
        "--compress",
        "cut-layer codec for activations and gradients",
        choices=CODECS,
    )
    peer: LinkSettings | None = None  # grpc mode, unless spawning
    spawn_backbone: bool = setting(
        False,
        "--spawn-backbone",
        "start the compute party on this machine (grpc mode; ended at exit)",
    )
    spawn_insecure: bool = False  # (--insecure with --spawn-backbone)
    connect_timeout_s: float = setting(
        DATA_PARTY_CONNECT_TIMEOUT_S,
        "--connect-timeout",
        "seconds to keep trying while the compute party is unreachable or busy "
        "(queued, in order of arrival)",
        low=0, low_open=True,
    )  # fmt: skip
    #: None: forever (its flag, ``--recv-timeout``, takes 0 or none for it)
    recv_timeout_s: float | None = DATA_PARTY_RECV_TIMEOUT_S
    #: "frozen": B runs its blocks forward only and no gradient crosses the
    #: cut (``split.defence.emulator``); "train": B's blocks train too
    backbone: str = setting(
        "train",
        "--backbone",
        "frozen: the compute party runs its blocks forward only, as the base "
        "has them, and no gradient crosses the cut (nothing A sends depends "
        "on its labels within a step); A trains its back blocks and head "
        "exactly (needs --init-from or --model hf:DIR; docs/privacy.md)",
        choices=proto.BACKBONES,
    )
    #: with a frozen backbone, how A's front blocks learn: through a local
    #: ``emulator`` of B's middle, or not at all (``frozen``)
    front_via: str = setting(
        "emulator",
        "--front-via",
        "with --backbone frozen, how A's front learns: through a local "
        "emulator of B's blocks built from the public base "
        "(split/defence/emulator.py), or not at all (frozen)",
        choices=FRONT_VIA,
    )
    emulator_blocks: int = setting(
        DEFAULT_BLOCKS,
        "--emulator-blocks",
        "of B's blocks in A's emulator, uniformly spaced (0: pass the "
        "gradient straight through)",
        low=0,
    )
    #: steps A trains alone on its data, through the emulator, before any
    #: activation leaves it (``split.defence.warmup``)
    private_warmup: int = setting(
        0,
        "--private-warmup",
        "train A's blocks and head alone on its own data for this many steps, "
        "through the emulator, before any activation leaves A: the front B "
        "then sees has drifted from the public base (needs --init-from)",
        low=0,
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.mode == "grpc" and self.peer is None and not self.spawn_backbone:
            raise ValueError("--mode grpc needs --peer HOST:PORT or --spawn-backbone")
        if self.mode == "local" and (self.peer is not None or self.spawn_backbone):
            raise ValueError("--peer/--spawn-backbone need --mode grpc")

    @property
    def frozen(self) -> bool:
        """No gradient crosses the cut (B's blocks frozen for the run)."""
        return self.backbone == "frozen"

    def record(self) -> dict:
        d = asdict(self)
        d["peer"] = self.peer.to_dict() if self.peer else None
        return d

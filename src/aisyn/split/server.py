"""``aisyn split serve``: a compute party serving data-party sessions over gRPC.

One session at a time (the link server turns a second caller away as busy).
A session that fails -- bad frames, a refused hello, a vanished peer, even a
bug -- is logged and ends, the data party being told why; the server keeps
listening, and since every session starts from B's checkpoint on disk, nothing
of a failed session survives it. A data party that goes quiet for longer than
the idle timeout loses its session, so it cannot hold the server forever,
and one that says hello and nothing more loses it after the shorter hello
timeout; callers waiting meanwhile are admitted in order of arrival by
identity (``link/admission.py``), so a party that reconnects at once goes
behind them.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from aisyn.link.base import LinkOptions, PeerHello
from aisyn.link.errors import LinkError
from aisyn.link.grpc_link import Accept, GrpcLinkServer
from aisyn.split.compute_party import ComputeParty, Session
from aisyn.split.pipeline import RanksOutOfStep, stop_ranks
from aisyn.split.session import failure_reason
from aisyn.split.transport import (
    COMPUTE_PARTY_HELLO_TIMEOUT_S,
    COMPUTE_PARTY_IDLE_TIMEOUT_S,
    LinkSettings,
    link_options,
)

log = logging.getLogger(__name__)


class SplitServer:
    """Wraps ``GrpcLinkServer``: the hello is checked during the link's
    handshake (a refusal reaches the data party as HandshakeError with B's
    reason), then the session's rounds run on the caller's thread.

    ``options.recv_timeout_s`` is the idle timeout (default
    ``COMPUTE_PARTY_IDLE_TIMEOUT_S``; None: wait forever);
    ``hello_timeout_s`` bounds the wait for a session's first round (None:
    the idle timeout).
    """

    def __init__(
        self,
        party: ComputeParty,
        settings: LinkSettings,
        options: LinkOptions | None = None,
        hello_timeout_s: float | None = COMPUTE_PARTY_HELLO_TIMEOUT_S,
    ) -> None:
        self.party = party
        if options is None:
            options = link_options(recv_timeout_s=COMPUTE_PARTY_IDLE_TIMEOUT_S)
        # The rounds read every frame: see link_options().
        options = dataclasses.replace(options, drop_unread=False)
        idle = options.recv_timeout_s
        if hello_timeout_s is None or (idle is not None and idle < hello_timeout_s):
            hello_timeout_s = idle  # never longer than the idle timeout
        self.hello_timeout_s = hello_timeout_s
        self.server = GrpcLinkServer(
            settings.address,
            **settings.security(),
            role="B",
            session=self._on_hello,
            options=options,
            data_listen=settings.data_address,
        )
        #: sessions run so far, and how many of them failed (for logs and tests)
        self.sessions_served = 0
        self.sessions_failed = 0

    @property
    def address(self) -> str:
        return self.server.address

    def _on_hello(self, peer: PeerHello) -> Accept:
        # The identity is the link's (certificate or token), not the hello's.
        reply, session = self.party.negotiate(peer.session, peer.identity)
        # The session travels with its own connection's link: two clients may
        # well send the same hello text.
        return Accept(reply, session)

    def start(self, address_file: str | Path | None = None) -> SplitServer:
        self.server.start()
        if address_file is not None:
            # Written only once listening, so a launcher may poll for it.
            path = Path(address_file)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(self.server.address)
            tmp.replace(path)
        log.info(
            "compute party for %s (cut %s) listening on %s",
            self.party.cfg.to_dict(),
            self.party.partition.describe(),
            self.server.address,
        )
        return self

    def serve_one(self, timeout: float | None = None) -> bool:
        """Accept and run one session; True if it ended cleanly."""
        link = self.server.accept(timeout)
        session: Session = link.agreed
        log.info("session for run %s (%s)", session.run_id, session.purpose)
        ok = False
        try:
            self.party.serve_session(
                link, session, first_round_timeout_s=self.hello_timeout_s
            )
            ok = True
        except RanksOutOfStep as e:
            # A pipelined party's ranks stopped at different points of a
            # round: nothing lines them up again, so the job ends (its state
            # on disk is the last checkpoint's, on every rank).
            link.abort(failure_reason(e))
            raise
        except Exception as e:  # a broken session must never take the server down
            if isinstance(e, LinkError | ValueError):  # incl. ProtocolError
                log.warning("session for run %s failed: %s", session.run_id, e)
            else:
                log.exception("session for run %s failed", session.run_id)
            # Tell the data party why (a no-op if the link already told it).
            link.abort(failure_reason(e))
        finally:
            link.close()
        self.sessions_served += 1
        self.sessions_failed += not ok
        return ok

    def serve_forever(self, max_sessions: int | None = None) -> None:
        n = 0
        while max_sessions is None or n < max_sessions:
            self.serve_one()
            n += 1
        if self.party.ranks is not None:
            stop_ranks(self.party.ranks)

    def stop(self) -> None:
        self.server.stop()

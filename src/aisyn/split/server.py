"""``aisyn split serve``: a compute party serving data-party sessions over gRPC.

One session at a time (the link server turns a second caller away as busy).
A session that fails -- bad frames, a refused hello, a vanished peer, even a
bug -- is logged and ends; the server keeps listening, and since every session
starts from B's checkpoint on disk, nothing of a failed session survives it.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from aisyn.link.base import LinkOptions, PeerHello
from aisyn.link.errors import FrameError, LinkError
from aisyn.link.grpc_link import GrpcLinkServer
from aisyn.split.compute_party import ComputeParty, Session
from aisyn.split.transport import LinkSettings

log = logging.getLogger(__name__)

_ABORT_GRACE_S = 1.0


class SplitServer:
    """Wraps ``GrpcLinkServer``: the hello is checked during the link's
    handshake (a refusal reaches the data party as HandshakeError with B's
    reason), then the session's rounds run on the caller's thread."""

    def __init__(
        self,
        party: ComputeParty,
        settings: LinkSettings,
        options: LinkOptions | None = None,
    ) -> None:
        self.party = party
        self._lock = threading.Lock()
        self._agreed: dict[str, Session] = {}
        self.server = GrpcLinkServer(
            settings.address,
            token=settings.token(),
            tls=settings.tls(),
            insecure=settings.insecure,
            allow_insecure_remote=settings.allow_insecure_remote,
            role="B",
            session=self._on_hello,
            options=options or LinkOptions(),
        )
        #: sessions run so far, and how many of them failed (for logs and tests)
        self.sessions_served = 0
        self.sessions_failed = 0

    @property
    def address(self) -> str:
        return self.server.address

    def _on_hello(self, peer: PeerHello) -> str:
        reply, session = self.party.negotiate(peer.session)
        with self._lock:
            self._agreed[peer.session] = session
        return reply

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
        with self._lock:
            session = self._agreed.pop(link.peer.session, None)
        if session is None:  # cannot happen: the hello callback ran first
            link.close()
            return False
        log.info("session for run %s (%s)", session.run_id, session.purpose)
        ok = False
        try:
            self.party.serve_session(link, session)
            ok = True
        except FrameError as e:
            log.warning("session for run %s failed: %s", session.run_id, e)
            # The link is already ending the call with the reason; closing it at
            # once can cancel the call before that status reaches the peer.
            time.sleep(_ABORT_GRACE_S)
        except (LinkError, ValueError) as e:  # incl. ProtocolError, CheckpointError
            log.warning("session for run %s failed: %s", session.run_id, e)
        except Exception:  # a broken session must never take the server down
            log.exception("session for run %s failed", session.run_id)
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

    def stop(self) -> None:
        self.server.stop()

"""``aisyn split serve``: a compute party serving data-party sessions over gRPC.

Up to ``max_sessions`` sessions at once (default one), each on a thread of
its own; a caller beyond that is told the server is busy and queued. With
``tenants`` (``split.centre.tenants``) every session belongs to the tenant its
credentials prove, runs in that tenant's folder, and holds a lease on its
quotas (sessions, memory, steps per hour) that its end gives back.
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

import ctypes
import ctypes.util
import dataclasses
import functools
import json
import logging
import math
import threading
import time
from pathlib import Path

from aisyn.link.base import LinkOptions, PeerHello
from aisyn.link.errors import HandshakeError, LinkError
from aisyn.link.grpc_server import Accept, GrpcLinkServer
from aisyn.model.cost import module_sizes
from aisyn.model.families import build_model
from aisyn.model.memory import Workload, party_load
from aisyn.model.segments import COMPUTE_PARTY
from aisyn.split.backbone.compute_party import ComputeParty, Session
from aisyn.split.backbone.ranks import RanksOutOfStep, stop_ranks
from aisyn.split.centre.metrics_endpoint import MetricsTls
from aisyn.split.centre.tenant_metrics import SessionRecord, TenantMetrics
from aisyn.split.centre.tenants import QuotaError, Tenant, TenantError, Tenants, Usage
from aisyn.split.session import failure_reason
from aisyn.split.transport import (
    COMPUTE_PARTY_HELLO_TIMEOUT_S,
    COMPUTE_PARTY_IDLE_TIMEOUT_S,
    LinkSettings,
    link_options,
)
from aisyn.train.device import autocast_on
from aisyn.train.lora import Method, lora_parameter_names

log = logging.getLogger(__name__)

#: the metrics' name for the data parties of a server without tenants
DEFAULT_TENANT = "-"
#: what a trainable fp32 parameter holds at B: itself, its gradient and
#: AdamW's two moments
TRAINABLE_BYTES_PER_PARAM = 4 * 4
#: glibc's ``mallopt`` parameter for the size from which a block is mapped
#: on its own, and unmapped when freed
M_MMAP_THRESHOLD = -3
#: blocks of this size and up go back to the OS as soon as they are freed
#: (glibc's own default, held fixed)
MMAP_THRESHOLD_BYTES = 128 * 1024


def return_large_blocks_to_os(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Make every freed block of ``threshold`` bytes or more go back to the
    OS at once, for the rest of this process (glibc; False elsewhere).

    glibc raises its mmap threshold to the size of each mapped block that is
    freed (up to 32 MiB): once the base's tensors have been read, a session's
    activations and temporaries (a quarter to a few MiB each) come from the
    malloc arena of the thread that runs it, and a freed block in the middle
    of an arena is kept, not returned. With a session per thread, each held
    about 50 MiB of such free memory on top of the ~25 MiB its adapters and
    activations use (``bench/tenants.py``). A fixed threshold maps those blocks
    one by one and unmaps them when freed; the cost, a fresh mapping's page
    faults per block, is small against the matmuls that fill them (and the
    link's receive buffers are pooled: ``link.assembly.ReceivePool``)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False  # not glibc: its allocator has its own policy
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))


def adapter_bytes(cfg, partition, method: Method) -> float:
    """What a LoRA session's adapters on B's blocks hold there: each fp32
    parameter, its gradient and its two AdamW moments."""
    meta = build_model(cfg, device="meta")
    names = lora_parameter_names(
        meta, method, within=partition.module_paths(COMPUTE_PARTY)
    )
    lora_numel = 0
    for name in names:
        if ".lora_A." in name:  # A is rank x in, B out x rank
            linear = meta.get_submodule(name.split(".lora_A.")[0])
            lora_numel += method.rank * (linear.in_features + linear.out_features)
    return float(TRAINABLE_BYTES_PER_PARAM * lora_numel)


class SplitServer:
    """Wraps ``GrpcLinkServer``: the hello is checked during the link's
    handshake (a refusal reaches the data party as HandshakeError with B's
    reason), then the session's rounds run on the caller's thread.

    ``options.recv_timeout_s`` is the idle timeout (default
    ``COMPUTE_PARTY_IDLE_TIMEOUT_S``; None: wait forever);
    ``hello_timeout_s`` bounds the wait for a session's first round (None:
    the idle timeout). ``max_sessions`` sessions run at once, holding at most
    ``memory_bytes`` at B in all (as the planner estimates each session).
    """

    def __init__(
        self,
        party: ComputeParty,
        settings: LinkSettings,
        options: LinkOptions | None = None,
        hello_timeout_s: float | None = COMPUTE_PARTY_HELLO_TIMEOUT_S,
        *,
        tenants: Tenants | None = None,
        max_sessions: int = 1,
        memory_bytes: float = math.inf,
        metrics_listen: str | None = None,
        metrics_tls: MetricsTls | None = None,
    ) -> None:
        if max_sessions > 1 and party.ranks is not None:
            raise ValueError(
                "a compute party spread over torchrun ranks serves one session "
                "at a time: --max-sessions must be 1"
            )
        if tenants is not None and party.ranks is not None:
            raise ValueError(
                "--tenants needs a one-process compute party (not torchrun ranks)"
            )
        if tenants is not None and party.root is not None:
            for name in tenants.by_name:
                # A run folder of a server that had no tenants, under this
                # name: the tenant's runs would land inside it.
                if (party.root / name / "config.json").is_file():
                    raise ValueError(
                        f"{party.root / name} is a run folder, not tenant "
                        f"{name}'s: serve the tenants from another --out, or "
                        "rename the tenant"
                    )
        self.party = party
        self.tenants = tenants
        self.usage = Usage(max_sessions, memory_bytes)
        # Without a tenants file every data party is one of a single pool,
        # bound to its runs by its link identity, as before.
        self._anyone = Tenant("", certificate="-", max_sessions=max_sessions)
        if options is None:
            options = link_options(recv_timeout_s=COMPUTE_PARTY_IDLE_TIMEOUT_S)
        # The rounds read every frame: see link_options().
        options = dataclasses.replace(options, drop_unread=False)
        idle = options.recv_timeout_s
        if hello_timeout_s is None or (idle is not None and idle < hello_timeout_s):
            hello_timeout_s = idle  # never longer than the idle timeout
        self.hello_timeout_s = hello_timeout_s
        own = [] if tenants is None else tenants.token_secrets()
        # With tenants of their own tokens, a shared one is optional: it is
        # what tenants known by their certificate alone present.
        security = settings.security(token_required=not own)
        if own:
            security["token"] = [security["token"]] * bool(security["token"]) + own
        self.server = GrpcLinkServer(
            settings.address,
            **security,
            role="B",
            session=self._on_hello,
            options=options,
            data_listen=settings.data_address,
            max_sessions=max_sessions,
        )
        self._threads: list[threading.Thread] = []
        #: per-tenant figures (``split.centre.tenant_metrics``); served on
        #: ``metrics_listen`` once started
        self.metrics = TenantMetrics()
        self.metrics_listen = metrics_listen
        self.metrics_tls = metrics_tls
        self.metrics_port: int | None = None
        #: sessions run so far (for tests)
        self.sessions_served = 0
        self._count_lock = threading.Lock()
        #: module sizes by model config, for sizing sessions and rounds
        self._sizes: dict[str, dict] = {}

    @property
    def address(self) -> str:
        return self.server.address

    def _on_hello(self, peer: PeerHello) -> Accept:
        tenant, owner = self._anyone, peer.identity
        if self.tenants is not None:
            try:
                tenant = self.tenants.resolve(peer)
            except TenantError as e:
                reason = f"compute party refused the session: {e}"
                raise HandshakeError(reason) from None
            owner = tenant.owner
        # The identity is the link's (certificate or token), not the hello's.
        reply, session = self.party.negotiate(peer.session, owner, tenant.name)
        # Sized only where a budget needs it (it builds the model on meta).
        sized = math.isfinite(self.usage.memory_bytes) or math.isfinite(
            tenant.memory_bytes
        )
        memory = self.session_bytes(session) if sized else 0.0
        label = tenant.name or DEFAULT_TENANT
        t0 = time.monotonic()
        try:
            lease = self.usage.open(tenant, session.run_id, memory)
        except QuotaError as e:
            self.metrics.refused(label, e.quota)
            raise HandshakeError(f"compute party refused the session: {e}") from None
        record = SessionRecord(
            label, session.run_id, session.purpose, time.time(),
            time.monotonic() - t0, memory,
        )  # fmt: skip
        self.metrics.opened(record)
        # Its steps count against the tenant's quota, its rounds in the metrics.
        lease.on_round = functools.partial(self.metrics.round, record)
        if sized:
            lease.round_bytes = functools.partial(self.round_bytes, session)
            lease.on_grow = functools.partial(self.metrics.grew, record)
        lease.on_refused = functools.partial(self.metrics.refused, label)
        folder = None
        if tenant.name and self.party.root is not None:
            folder = self.party.root / tenant.name
        lease.on_close = lambda: self.metrics.closed(
            record, folder, session.outcome or "never opened"
        )
        session.lease = lease
        # The session travels with its own connection's link: two clients may
        # well send the same hello text.
        return Accept(reply, session, on_closed=lease.close)

    def session_bytes(self, session: Session) -> float:
        """What a session holds at B whatever its rounds, as the planner
        estimates it: B's weights, gradients and AdamW state. A LoRA session
        over the base this party shares holds its adapters alone (with their
        gradients and AdamW state: ``adapter_bytes``); the base itself is
        held once (``Usage.resident_bytes``, set when it is first counted).
        Each TRAIN round's activations come on top (``round_bytes``): B learns
        a run's batch size only from its rounds."""
        (r,) = self._load(session, 1, 1, 1, 0).ranks
        if session.lora is not None:  # the shared, frozen base: see above
            if not self.usage.resident_bytes:
                self.usage.resident_bytes = r.weights_bytes
            cfg = session.cfg or self.party.cfg
            return adapter_bytes(cfg, self.party.partition, session.lora[0])
        return r.weights_bytes + r.grads_bytes + r.optimizer_bytes + r.cache_bytes

    def round_bytes(
        self, session: Session, micro_batches: int, rows: int, seq_len: int, window: int
    ) -> float:
        """The activations a TRAIN round of this size holds at B at its peak
        (``window`` + 1 micro-batches in flight, at most all of them)."""
        (r,) = self._load(session, micro_batches, rows, seq_len, window).ranks
        return r.activation_bytes

    def _load(self, session: Session, m: int, rows: int, seq_len: int, window: int):
        cfg = session.cfg or self.party.cfg
        train = session.train
        work = Workload(
            batch_size=m * rows,
            micro_batch_size=rows,
            seq_len=seq_len,
            in_flight=min(m, window + 1),
            autocast=autocast_on(self.party.device, train.autocast),
            activation_checkpointing=train.activation_checkpointing,
        )
        key = json.dumps(cfg.to_dict(), sort_keys=True)
        with self._count_lock:
            sizes = self._sizes.get(key)
        if sizes is None:
            sizes = module_sizes(build_model(cfg, device="meta"))
            with self._count_lock:
                self._sizes[key] = sizes
        return party_load(sizes, cfg, self.party.partition, COMPUTE_PARTY, work)

    def start(self, address_file: str | Path | None = None) -> SplitServer:
        if self.metrics_listen is not None:
            self.metrics_port = self.metrics.serve(
                self.metrics_listen, self.metrics_tls
            )
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
        return self._serve_link(self.server.accept(timeout))

    def _serve_link(self, link) -> bool:
        session: Session = link.agreed
        log.info("session for run %s (%s)", session.run_id, session.purpose)
        ok = False
        session.outcome = "failed"
        try:
            self.party.serve_session(
                link, session, first_round_timeout_s=self.hello_timeout_s
            )
            ok = True
            session.outcome = "ended"
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
            session.outcome = f"failed: {failure_reason(e)}"
            link.abort(failure_reason(e))
        finally:
            link.close()  # gives the session's lease back
        with self._count_lock:
            self.sessions_served += 1
        return ok

    def serve_forever(self, max_sessions: int | None = None) -> None:
        """Serve sessions (``max_sessions`` of them, then return; None: until
        stopped), each on a thread of its own when several may run at once."""
        n = 0
        while max_sessions is None or n < max_sessions:
            if self.usage.max_sessions == 1:
                self.serve_one()
            else:
                self.serve_in_background()
            n += 1
        self.join()
        if self.party.ranks is not None:
            stop_ranks(self.party.ranks)

    def serve_in_background(self, timeout: float | None = None) -> threading.Thread:
        """Accept the next session and run it on a thread of its own."""
        link = self.server.accept(timeout)
        thread = threading.Thread(
            target=self._serve_link, args=(link,), name="split-session", daemon=True
        )
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return thread

    def join(self, timeout: float | None = None) -> None:
        """Wait for the sessions running in the background to end."""
        for t in list(self._threads):
            t.join(timeout)

    def stop(self) -> None:
        self.server.stop()
        self.metrics.stop()

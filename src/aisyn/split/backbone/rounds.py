"""The compute party's side of a session's rounds, in one process.

``ComputeParty.serve_session`` runs one ``Rounds`` per session: it reads each
round's control tensor from the data party and runs it -- a TRAIN step over
the micro-batches in ``split.schedule``'s order, an EVAL forward, a generation
step on B's share of the KV cache, a SAVE. ``split.backbone.pipeline`` runs the same
rounds over the ranks of a torchrun job.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import TYPE_CHECKING

import torch

from aisyn.link.base import Link
from aisyn.model.causal_lm import masks_from_documents
from aisyn.model.segments import StageCache
from aisyn.split import protocol as proto
from aisyn.split import schedule
from aisyn.split.party import PartyState, SkippedStep
from aisyn.train import checkpoint as ckpt
from aisyn.train.device import autocast_for

if TYPE_CHECKING:
    from aisyn.split.backbone.compute_party import ComputeParty, Session

log = logging.getLogger(__name__)


class Rounds:
    """B's side of the rounds of one session: the control of each round from
    the data party, and what B does for it (train, evaluate, generate, save)."""

    def __init__(
        self,
        party: ComputeParty,
        state: PartyState,
        link: Link,
        session: Session,
        first_round_timeout_s: float | None = None,
    ) -> None:
        self.party = party
        self.first_round_timeout_s = first_round_timeout_s
        self.state = state
        self.link = link
        self.session = session
        (self.middle,) = state.segments
        self.next_step = session.start_step
        self.hidden = state.cfg.hidden_size
        #: the KV cache of B's blocks for the sequence being generated
        self.gen_cache: StageCache | None = None
        #: other tenants' micro-batches go through the base with this
        #: session's (``split.centre.tenant_batch``), or None: on its own
        self.batcher = None
        if session.purpose == "train":
            self.batcher = party.batcher_for(session, state)
        if self.batcher is not None:
            self.adapter_layers = self.batcher.session_layers(state.model)
            self.adapter_params = [p for _, p in state.named]

    #: whether this process logs the session's events (rank 0 of several)
    speaks = True

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's checkpoint files (name -> tensors)."""
        return self.state.tensors()

    def run(self) -> None:
        try:
            self._rounds()
        finally:
            self.gen_cache = None  # a generation left open ends with the session

    def _rounds(self) -> None:
        r = 0
        # the operator's metrics (a compute centre's lease); the other ranks
        # of a pipelined party have none, nor a link of their own
        metered = getattr(self.session.lease, "on_round", None) is not None
        while (c := self._next_control(r)) is not None:
            if metered:
                cpu, sent, received = time.thread_time(), *self._bytes()
            step = self.next_step
            if c.op == proto.TRAIN:
                self._fits(c)
                self._train(r, c)
            elif c.op == proto.EVAL:
                self._eval(r, c)
            elif c.op in proto.GEN_OPS:
                self._generate(r, c)
            else:
                self._save(r, c)
            if metered:
                self._meter(c, step, cpu, sent, received)
            r += 1

    def _fits(self, c: proto.Control) -> None:
        """Before a TRAIN round's work: its size within the session's memory
        quota. B learns a run's batch size only from its rounds, so the
        lease grows to the largest round's needs, refused with the numbers
        when that passes the tenant's or the server's budget."""
        fits = getattr(self.session.lease, "fits_round", None)
        if fits is not None:
            fits(c.micro_batches, c.micro_size, c.seq_len, c.window)

    def _turn(self) -> contextlib.AbstractContextManager[None]:
        """A turn at B's compute among the sessions of other tenants (a
        session without a lease -- in-process -- has B to itself)."""
        lease = self.session.lease
        return contextlib.nullcontext() if lease is None else lease.compute()

    def _bytes(self) -> tuple[int, int]:
        return self.link.bytes_sent, self.link.bytes_received

    def _meter(
        self, c: proto.Control, step: int, cpu: float, sent: int, received: int
    ) -> None:
        """Report the round to the session's lease (the operator's metrics):
        the steps it took, their tokens, this thread's CPU time on it (each
        session has a thread of its own) and its bytes each way."""
        report = self.session.lease.on_round
        steps = self.next_step - step  # 0 if skipped or not a TRAIN round
        now_sent, now_received = self._bytes()
        report(
            steps=steps,
            tokens=steps * c.micro_batches * c.micro_size * c.seq_len,
            compute_s=time.thread_time() - cpu,
            received=now_received - received,
            sent=now_sent - sent,
        )

    def _next_control(self, r: int) -> proto.Control | None:
        """Round ``r``'s control from A; None when A ended the session."""
        from aisyn.link.errors import PeerClosedError, PeerLostError

        try:
            t = self.link.recv(
                "ctl",
                step=r,
                shape=(7,),
                dtype=torch.int64,
                # A hello and silence must not hold the server for long.
                timeout=self.first_round_timeout_s if r == 0 else None,
            )
        except PeerClosedError:
            # A said goodbye between rounds: the normal end of a session.
            log.info(
                "session for run %s ended: the data party closed it after %d round(s)",
                self.session.run_id,
                r,
            )
            return None
        except PeerLostError as e:
            # A went away between rounds: nothing is half done, but it did
            # not say goodbye, so say what happened.
            log.warning(
                "session for run %s ended between rounds: %s", self.session.run_id, e
            )
            return None
        return proto.Control.parse(t, self.state.cfg.seq_len)

    def _recv_act_doc(
        self, r: int, i: int, c: proto.Control
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Micro-batch ``i``'s activations from A as they arrive, and its
        document ids when A resets attention at EOD (None otherwise)."""
        shape = (c.micro_size, c.seq_len, self.hidden)
        x = self.link.recv("act", step=r, micro=i, shape=shape, dtype=torch.float32)
        doc = None
        if c.eod:
            doc = self.link.recv(
                "doc", step=r, micro=i, shape=shape[:2], dtype=torch.int32
            )
        return x, doc

    def _recv_act(self, r: int, i: int, c: proto.Control) -> tuple[torch.Tensor, ...]:
        x, doc = self._recv_act_doc(r, i, c)
        mask = None
        if doc is not None:
            mask, _ = masks_from_documents(doc.to(self.state.device, torch.int64))
        return x.to(self.state.device), mask

    def _at_next_step(self, c: proto.Control, name: str) -> None:
        """A round that moves training on (TRAIN, SAVE) comes only in a
        training session, at the step this party is at; ``name``: the round
        as the messages call it."""
        if self.session.purpose != "train":
            raise proto.ProtocolError(
                f"{proto.OPS[c.op]} round in an evaluation session"
            )
        if c.step != self.next_step:
            raise proto.ProtocolError(
                f"{name} for step {c.step}, this party is at step {self.next_step}"
            )

    def _train(self, r: int, c: proto.Control) -> None:
        self._at_next_step(c, "TRAIN round")
        if self.session.lease is not None:
            # Before any of the step's work: a refused step leaves both
            # parties at the last one, and every checkpoint as it was.
            try:
                self.session.lease.before_step()
            except ValueError as e:  # a QuotaError: counted, then it ends
                report = getattr(self.session.lease, "on_refused", None)
                if report is not None:
                    report(getattr(e, "quota", "steps_per_hour"))
                raise
        if self.session.frozen:
            self._train_frozen(r, c)
            return
        self.state.train(True)
        inflight: dict[int, tuple] = {}
        shape = (c.micro_size, c.seq_len, self.hidden)
        for kind, i in schedule.make(c.micro_batches, c.window).b:
            if kind == "F":
                x, mask = self._recv_act(r, i, c)
                self._train_input(x, "activations", i)
                x.requires_grad_()
                slot = None
                if self.batcher is not None and mask is None:
                    slot = self.batcher.forward(
                        x,
                        self.adapter_layers,
                        self.adapter_params,
                        self._turn,
                        self.state.autocast,
                    )
                    y = slot.y
                else:
                    with self._turn(), self.state.autocast():  # as aisyn train
                        y = self.middle(x, mask)
                self.link.send("out", y, step=r, micro=i, codec=self.session.codec)
                inflight[i] = (x, y, slot)
            else:
                g = self.link.recv(
                    "gout", step=r, micro=i, shape=shape, dtype=torch.float32
                )
                self._train_input(g, "gradient of the output", i)
                x, y, slot = inflight.pop(i)
                if slot is not None:
                    slot.backward(g.to(self.state.device), self._turn)
                else:
                    with self._turn():
                        torch.autograd.backward(y, g.to(self.state.device))
                self.link.send(
                    "gact", x.grad, step=r, micro=i, codec=self.session.codec
                )
        mine = self.state.local_sq_norm()  # NaN: this party skips the step
        self._apply_step(c, self._exchange_norms(r, mine), mine)

    @torch.no_grad()
    def _train_frozen(self, r: int, c: proto.Control) -> None:
        """A TRAIN round of a frozen backbone: each micro-batch forward only
        (no graph kept, no dropout), in the order A sends them; no gradient
        comes or goes. The norms exchanged are only A's go/skip (0 or NaN)
        and B's 0, so both parties keep the same steps."""
        self.state.train(False)
        for i in range(c.micro_batches):
            x, mask = self._recv_act(r, i, c)
            self._train_input(x, "activations", i)
            with self._turn(), self.state.autocast():
                y = self.middle(x, mask)
            self.link.send("out", y, step=r, micro=i, codec=self.session.codec)
        mine = 0.0 if self.state.problem is None else math.nan
        theirs = self._exchange_norms(r, mine)
        problem, self.state.problem = self.state.problem, None
        if problem is not None or not theirs == 0.0:
            if self.speaks:
                why = problem or f"the data party skips step {c.step}"
                log.warning(
                    "run %s: step %d skipped: %s", self.session.run_id, c.step, why
                )
            return
        self.next_step = c.step + 1

    def _train_input(self, t: torch.Tensor, kind: str, i: int) -> None:
        """A TRAIN round's ``kind`` of tensor from A for micro-batch ``i``,
        noted if it is not finite (``PartyState.checked``)."""
        self.state.checked(t, f"the {kind} (micro-batch {i})")

    def _exchange_norms(self, r: int, mine: float) -> float:
        """Send B's squared gradient norm; A's."""
        self.link.send_scalar("sqnorm", mine, step=r)
        return self.link.recv_scalar("sqnorm", step=r)

    def _apply_step(self, c: proto.Control, theirs: float, mine: float) -> None:
        try:
            self.state.apply_step(c.step, theirs, mine)
        except SkippedStep as e:
            # The data party takes the same decision from the same two numbers;
            # B stays at this step, and the session goes on if A wants it to.
            if self.speaks:
                log.warning("run %s: %s", self.session.run_id, e)
            return
        self.next_step = c.step + 1

    @torch.no_grad()
    def _eval(self, r: int, c: proto.Control) -> None:
        self.state.train(False)
        x, mask = self._recv_act(r, 0, c)
        with self._turn(), autocast_for(self.state.device):
            y = self.middle(x, mask)
        self.link.send("out", y, step=r, codec=self.session.codec)

    @torch.no_grad()
    def _generate(self, r: int, c: proto.Control) -> None:
        """One generation round: open the cache, run the next positions through
        it, or free it. Tokens never arrive, only the front's hidden states."""
        if self.session.purpose != "generate":
            raise proto.ProtocolError(
                f"{proto.OPS[c.op]} round in a {self.session.purpose} session"
            )
        if c.op == proto.GEN_START:
            if self.gen_cache is not None:
                raise proto.ProtocolError(
                    "GEN_START while a generation is open (end it first)"
                )
            self.state.train(False)
            self.gen_cache = self.middle.new_cache(c.seq_len)
            return
        cache = self.gen_cache
        if cache is None:
            raise proto.ProtocolError(f"{proto.OPS[c.op]} with no generation open")
        if c.op == proto.GEN_END:
            self.gen_cache = None  # the keys and values go with it
            return
        first, count = c.step, c.seq_len
        if first != cache.length or first + count > cache.capacity:
            raise proto.ProtocolError(
                f"GEN_STEP for positions [{first}, {first + count}): the cache "
                f"holds {cache.length} of {cache.capacity}"
            )
        x = self._generation_input(r, count)
        if x is None:
            # Nothing to skip as in training: a bad position would poison every
            # later one through the cache, so the session ends.
            raise proto.ProtocolError(
                f"non-finite activations for positions [{first}, {first + count})"
            )
        self._generation_step(r, x, cache)

    def _generation_input(self, r: int, count: int) -> torch.Tensor | None:
        """The front's hidden states of the next ``count`` positions (None:
        they are not finite)."""
        x = self.link.recv(
            "act", step=r, shape=(1, count, self.hidden), dtype=torch.float32
        )
        return x.to(self.state.device) if bool(torch.isfinite(x).all()) else None

    def _generation_step(self, r: int, x: torch.Tensor, cache: StageCache) -> None:
        # fp32 on every device, as the data party and ``aisyn generate`` run
        with self._turn():
            y = self.middle(x, cache=cache)
        self.link.send("out", y, step=r, codec=self.session.codec)

    def _save(self, r: int, c: proto.Control) -> None:
        self._at_next_step(c, "SAVE")
        if self.party.run_dir(self.session.run_id, self.session.tenant) is None:
            log.warning("asked to checkpoint step %d but serving without --out", c.step)
            self.link.send_scalar("saved", -1.0, step=r)
            return
        t0 = time.perf_counter()
        try:
            folder = self.party.save_checkpoint(self.session, self.state, c.step)
        except (OSError, ckpt.CheckpointError) as e:
            log.error("checkpoint of step %d failed: %s", c.step, e)
            self.link.send_scalar("saved", -1.0, step=r)
            return
        log.info("saved %s (%.2f s)", folder, time.perf_counter() - t0)
        self.link.send_scalar("saved", float(c.step), step=r)

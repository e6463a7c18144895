"""One backbone at the compute party, trained by several data parties (SplitFed).

In split training proper each data party's run has a backbone of its own at
B. A consortium shares one: every member's TRAIN rounds step the same middle
blocks and optimizer, and a newcomer joins a backbone shaped by all. This is
SplitFed's second variant (Thapa et al., "SplitFed: When Federated Learning
Meets Split Learning", AAAI 2022, SFLV2): B takes the members' steps one after
another, each whole -- forward, backward and the optimizer step under one lock
-- so a member's backward always runs through the weights its forward saw, and
the backbone's gradient is never the sum of two members' steps. The members'
own segments (embedding, front, back, head) are averaged by whoever runs the
federation (``aisyn.splitfed``); B never sees them.

What B learns is what a single data party's session shows it (docs/split.md),
once per member; the backbone's schedule counts its own steps (the members'
together), each member keeps its own step count for its rounds.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from aisyn.link.base import Link
from aisyn.split import protocol as proto
from aisyn.split.compute_party import ComputeParty, Session
from aisyn.split.party import SkippedStep
from aisyn.split.rounds import Rounds

log = logging.getLogger(__name__)


class SharedBackbone:
    """B's middle blocks and optimizer for all of a consortium's members.

    ``session`` is the consortium's own (its hello from the federation's
    driver): its run id names the backbone's run folder under B's root, its
    training settings the backbone's optimizer and schedule (over all the
    members' steps), its LoRA settings the adapters every member trains."""

    def __init__(self, party: ComputeParty, session: Session) -> None:
        if session.purpose != "train" or session.start_step:
            raise proto.ProtocolError(
                "a consortium's backbone starts fresh (resuming one is not supported)"
            )
        self.party = party
        self.session = session
        self.state = party.session_state(session)
        self.lock = threading.Lock()
        #: the backbone's optimizer steps so far, every member's together
        self.step = 0
        self.skipped = 0

    def serve(self, link: Link, member: Session) -> None:
        """Run ``member``'s rounds against the shared backbone until its data
        party closes the link."""
        self.check_member(member)
        SharedRounds(self, link, member).run()

    def check_member(self, member: Session) -> None:
        """Refuse a member that asks for another backbone than this one."""
        if member.purpose != "train" or member.start_step:
            raise proto.ProtocolError(
                f"run {member.run_id}: a consortium member trains from the "
                "backbone as it is (no resume, evaluation or generation session)"
            )
        mine = _lora_shape(self.session)
        if _lora_shape(member) != mine:
            raise proto.ProtocolError(
                f"run {member.run_id} asks for LoRA {_lora_shape(member) or 'off'} on "
                f"the backbone; the consortium's is {mine or 'full training'}"
            )
        if member.cfg != self.session.cfg:
            raise proto.ProtocolError(
                f"run {member.run_id}: its model config differs from the "
                "consortium's backbone's"
            )

    def save(self) -> Path:
        """Checkpoint the backbone at its current step (B's run folder of the
        consortium's run id); between two members' steps."""
        with self.lock:
            return self.party.save_checkpoint(self.session, self.state, self.step)


def _lora_shape(session: Session) -> tuple[int, float] | None:
    if session.lora is None:
        return None
    method = session.lora[0]
    return method.rank, method.alpha


class SharedRounds(Rounds):
    """A member's rounds, every TRAIN and EVAL round of which holds the
    backbone for its whole length."""

    def __init__(self, backbone: SharedBackbone, link: Link, member: Session) -> None:
        super().__init__(backbone.party, backbone.state, link, member)
        self.backbone = backbone

    def _train(self, r: int, c: proto.Control) -> None:
        with self.backbone.lock:
            super()._train(r, c)

    def _eval(self, r: int, c: proto.Control) -> None:
        with self.backbone.lock:  # (its train/eval mode is the backbone's)
            super()._eval(r, c)

    def _save(self, r: int, c: proto.Control) -> None:
        raise proto.ProtocolError(
            "SAVE round from a consortium member: the shared backbone is "
            "checkpointed by the consortium after each round, not by one member"
        )

    def _apply_step(self, c: proto.Control, theirs: float, mine: float) -> None:
        b = self.backbone
        try:
            # the backbone's own step: its schedule runs over every member's
            b.state.apply_step(b.step, theirs, mine)
        except SkippedStep as e:
            b.skipped += 1
            log.warning("consortium member %s: %s", self.session.run_id, e)
            return
        b.step += 1
        self.next_step = c.step + 1

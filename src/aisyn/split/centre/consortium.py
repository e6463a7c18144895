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

A member that lies about its cut tensors is kept off the backbone. Non-finite
values skip its step on both sides (``PartyState.checked``), as in any
session. Finite but huge ones (activations or gradients x1e6) are bounded
relative to the other members': B ends the session of a member whose step's
cut tensors exceed ``cut_bound`` of the other members' (the federated guard's
rule: k times their lower median, ``fl.guard.norm_bound``, passed in by
the federation's driver) before that step touches the backbone. What is
compared, per kind: the RMS of the step's activations, and of its output
gradients times the activations' RMS (the back's layer norm makes the
gradient of huge activations tiny, and a tiny one would make every honest
member's look huge); for each other member, the largest of its steps
applied so far (an honest member's gradients shrink as it trains, and one
compared with another's latest would look huge at the start of its round).
As with the guard, a member's first steps before any other member's have
nothing to be compared with, and with two members nothing tells which one is
honest (a member whose tensors are tiny makes the other's look huge).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from aisyn.link.base import Link
from aisyn.split import protocol as proto
from aisyn.split.backbone.compute_party import ComputeParty, Session
from aisyn.split.backbone.rounds import Rounds
from aisyn.split.party import SkippedStep

log = logging.getLogger(__name__)


class SharedBackbone:
    """B's middle blocks and optimizer for all of a consortium's members.

    ``session`` is the consortium's own (its hello from the federation's
    driver): its run id names the backbone's run folder under B's root, its
    training settings the backbone's optimizer and schedule (over all the
    members' steps), its LoRA settings the adapters every member trains."""

    def __init__(
        self,
        party: ComputeParty,
        session: Session,
        cut_bound: CutBound | None = None,
        cut_ratio: float = 0.0,
    ) -> None:
        """``cut_bound(values, cut_ratio)``: the largest RMS of a member's cut
        tensors accepted among the members' ``values`` (None: no bound)."""
        if session.purpose != "train":
            raise proto.ProtocolError(
                f"a consortium's backbone trains (not a {session.purpose} session)"
            )
        self.party = party
        self.session = session
        # a resumed consortium's session starts at its last checkpoint
        self.state = party.session_state(session)
        self.lock = threading.Lock()
        #: the backbone's optimizer steps so far, every member's together
        self.step = session.start_step
        self.skipped = 0
        self.cut_bound = cut_bound
        self.cut_ratio = cut_ratio
        #: member -> kind of cut tensor -> the largest of its steps applied
        #: (what the others' are bounded by)
        self.cut_rms: dict[str, dict[str, float]] = {}

    def record(self) -> dict:
        """What a resumed consortium needs of this backbone beyond its
        checkpoint: the steps it skipped and the bound's history."""
        return {"skipped": self.skipped, "cut_rms": self.cut_rms}

    def restore(self, record: dict) -> None:
        """``record()`` of the checkpoint this backbone resumed from."""
        skipped, cut_rms = record.get("skipped"), record.get("cut_rms")
        if not isinstance(skipped, int) or not isinstance(cut_rms, dict):
            raise ValueError(f"bad backbone record {str(record)[:80]}")
        try:
            self.cut_rms = {
                str(n): {str(k): float(v) for k, v in kinds.items()}
                for n, kinds in cut_rms.items()
            }
        except (AttributeError, TypeError, ValueError):
            raise ValueError(f"bad backbone record {str(record)[:80]}") from None
        self.skipped = skipped

    def serve(
        self, link: Link, member: Session, name: str | None = None, at_step: int = 0
    ) -> None:
        """Run ``member``'s rounds against the shared backbone until its data
        party closes the link (``name``: the member in B's log lines; its run
        id if not given). ``at_step``: the member's own step count, where a
        resumed consortium continues it (the driver's record, not the
        member's say)."""
        self.check_member(member)
        rounds = SharedRounds(self, link, member, name or member.run_id)
        rounds.next_step = at_step
        rounds.run()

    def cut_problem(self, name: str, rms: dict[str, float]) -> str | None:
        """Why member ``name``'s step, whose cut tensors have the RMS ``rms``
        (kind -> value), must not reach the backbone; None if it may."""
        if self.cut_bound is None:
            return None
        for kind, value in rms.items():
            others = [v[kind] for n, v in self.cut_rms.items() if n != name]
            limit = self.cut_bound([*others, value], self.cut_ratio)
            if limit is not None and not value <= limit:  # (inf and NaN too)
                return (
                    f"{CUT_KINDS[kind]} is {value:.4g}, over {self.cut_ratio:g} x "
                    f"the members' median {limit / self.cut_ratio:.4g} "
                    "(max-norm-ratio)"
                )
        return None

    def applied(self, name: str, rms: dict[str, float]) -> None:
        """Member ``name``'s step, of cut tensors ``rms``, moved the backbone."""
        mine = self.cut_rms.setdefault(name, {})
        for kind, value in rms.items():
            mine[kind] = max(mine.get(kind, 0.0), value)

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


#: what ``SharedBackbone`` bounds of a member's step, as its messages say it
CUT_KINDS = {
    "activations": "the RMS of its activations",
    "gradients": "the RMS of its output gradients times its activations'",
}
#: ``cut_bound(values, ratio)`` (``fl.guard.norm_bound``)
CutBound = Callable[[list[float], float], float | None]


class CutOutOfBound(proto.ProtocolError):
    """A member's cut tensors are far larger than the other members'."""


def _lora_shape(session: Session) -> tuple[int, float] | None:
    if session.lora is None:
        return None
    method = session.lora[0]
    return method.rank, method.alpha


class SharedRounds(Rounds):
    """A member's rounds, every TRAIN and EVAL round of which holds the
    backbone for its whole length."""

    def __init__(
        self, backbone: SharedBackbone, link: Link, member: Session, name: str
    ) -> None:
        super().__init__(backbone.party, backbone.state, link, member)
        self.backbone = backbone
        self.name = name
        #: kind of cut tensor -> (sum of squares, count) over this step
        self.cut_sq: dict[str, tuple[torch.Tensor, int]] = {}
        self.step_rms: dict[str, float] = {}

    def _train(self, r: int, c: proto.Control) -> None:
        with self.backbone.lock:
            self.cut_sq = {}
            try:
                super()._train(r, c)
            except BaseException:
                # A step that ends half way has left its gradients on the
                # shared backbone: never let the next member's step add to them.
                self.state.zero_grad()
                raise

    def _train_input(self, t: torch.Tensor, kind: str, i: int) -> None:
        super()._train_input(t, kind, i)
        # (the norm in the tensor's float32: float64 is not on every device;
        # one past its range is inf, which no bound accepts)
        sq = torch.linalg.vector_norm(t.detach().float()).double().square()
        total, count = self.cut_sq.get(kind, (0.0, 0))
        self.cut_sq[kind] = total + sq, count + t.numel()

    def _exchange_norms(self, r: int, mine: float) -> float:
        # After the step's backward, before it is applied: a member's
        # out-of-bound step ends its session and never moves the backbone.
        rms = {
            kind: math.sqrt(float(sq) / max(count, 1))
            for kind, (sq, count) in self.cut_sq.items()
        }
        act = rms.get("activations", 0.0)
        self.step_rms = {
            "activations": act,
            "gradients": rms.get("gradient of the output", 0.0) * act,
        }
        if self.state.problem is None:  # (non-finite: skipped on both sides)
            problem = self.backbone.cut_problem(self.name, self.step_rms)
            if problem is not None:
                raise CutOutOfBound(
                    f"consortium member {self.name}: {problem}; its session is "
                    "ended and its step not applied"
                )
        return super()._exchange_norms(r, mine)

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
            log.warning("consortium member %s: %s", self.name, e)
            return
        b.step += 1
        b.applied(self.name, self.step_rms)
        self.next_step = c.step + 1

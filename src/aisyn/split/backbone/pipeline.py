"""Party B's backbone over the ranks of a torchrun job: pipeline stages.

``torchrun --nproc-per-node R -m aisyn.cli split serve ...`` spreads the
middle blocks over R ranks (``stage_blocks``: contiguous runs, the earlier
ranks taking one more when they do not divide evenly), each rank
materialising only its own (``Partition.rank_share``). They run as the
stages of a ``torch.distributed.pipelining`` pipeline. Rank 0 alone listens
for data parties and talks to them; a data party cannot tell a pipelined
compute party from a single process.

Per round, rank 0 receives A's control tensor and broadcasts it. In a TRAIN
round every rank runs, for its stage, the order of forwards and backwards a
single compute party runs (``split.schedule``'s list for A's window), as a
custom schedule of the pipelining runtime: stage 0 takes each micro-batch's
activations from the link as they arrive, so A's window decides what is in
flight; the last stage hands its output to a relay thread on rank 0, which
sends it to A and passes A's gradient back to it; stage 0's input gradient
goes to A from a hook. The squared gradient norms of the ranks are summed;
rank 0 exchanges the sum with A and broadcasts A's, and every rank steps its
own optimizer with the same two numbers, so the update is the single
process's. An EVAL round runs the same pipeline forward only; a SAVE round
has every rank save its share (``split.backbone.shards``).

Failures: a round refused before it starts (a step out of order) ends the
session on every rank alike, and B goes on serving. A failure inside a round
leaves the ranks at different points of it, with no way to line them up again:
the job ends (``RanksOutOfStep``) with one line, as a killed rank ends it, and
torchrun (``--max-restarts``) or the operator starts it again from the last
checkpoint, which every rank still has.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    _PipelineScheduleRuntime,
)

from aisyn.model.causal_lm import masks_from_documents
from aisyn.split import protocol as proto
from aisyn.split import schedule
from aisyn.split.backbone.ranks import END, Ranks, RanksOutOfStep
from aisyn.split.backbone.rounds import Rounds
from aisyn.split.sharding import (
    gather_rows,
    gathered_tensors,
    scatter_rows,
    shard_blocks,
    shard_sq_norm,
)
from aisyn.train.device import autocast_for

log = logging.getLogger(__name__)


#: the stages' order in an evaluation round (its backward is skipped)
EVAL_ORDER = [("F", 0), ("B", 0)]


class _ToRelay(torch.autograd.Function):
    """The last stage's output leaves for rank 0 (and A); in backward, A's
    gradient of it comes back. Its value is a zero scalar: the pipeline's
    "loss", whose gradient (one) is replaced by A's."""

    @staticmethod
    def forward(ctx, y, rounds):
        ctx.rounds, ctx.shape = rounds, y.shape
        dist.send(y.detach().float().contiguous(), 0, group=rounds.ranks.relay)
        return y.new_zeros(())

    @staticmethod
    def backward(ctx, _one):
        rounds = ctx.rounds
        g = torch.empty(ctx.shape, device=rounds.state.device)
        dist.recv(g, 0, group=rounds.ranks.relay)
        rounds.state.checked(g, "the gradient of the output")
        return g, None


class _Stage(nn.Module):
    """This rank's blocks as a pipeline stage. Between stages travel the
    hidden states, the micro-batch's index and, with EOD-reset attention, its
    document ids (each stage makes the masks from them)."""

    def __init__(self, rounds) -> None:
        super().__init__()
        self.rounds = (rounds,)  # not a submodule: parameters stay the model's

    def forward(self, *inputs):
        rounds = self.rounds[0]
        first, last = rounds.ranks.rank == 0, rounds.ranks.rank == rounds.ranks.last
        if first:
            (index,) = inputs
            x, doc = rounds.act_from_link(int(index[0]))
        else:
            x, index, *rest = inputs
            doc = rest[0] if rest else None
        mask = None
        if doc is not None:
            mask, _ = masks_from_documents(doc.to(torch.int64))
        # as the single-process rounds: training's autocast, evaluation's
        train = torch.is_grad_enabled()
        with rounds.state.autocast() if train else autocast_for(rounds.state.device):
            y = rounds.middle(x, mask)
        if last:
            return _ToRelay.apply(y, rounds)
        y = y.float()
        return (y, index) if doc is None else (y, index, doc)


def _actions(order: list[tuple[str, int]], stage: int) -> list[_Action]:
    kinds = {"F": _ComputationType.FORWARD, "B": _ComputationType.FULL_BACKWARD}
    return [_Action(stage, kinds[k], i) for k, i in order]


def _runtime(
    stage: PipelineStage, ranks: Ranks, order: list[tuple[str, int]], m: int
) -> _PipelineScheduleRuntime:
    """The pipelining runtime over ``order`` on every stage. Gradients are
    A's, summed over micro-batches as a single compute party sums them (no
    scaling); the "loss" is ``_ToRelay``'s zero. ``eval()`` runs it forward
    only (the backwards are skipped)."""
    runtime = _PipelineScheduleRuntime(
        [stage], m, loss_fn=lambda token, _index: token, scale_grads=False
    )
    runtime._prepare_schedule_with_comms(
        {k: _actions(order, k) for k in range(ranks.world)}
    )
    return runtime


class _RankRounds(Rounds):
    """What the rounds of every rank of a compute party spread over a torchrun
    job share: rank 0 alone on the link, the control and A's norm handed to
    the others, a round refused alike on every rank, saving every share."""

    def __init__(self, party, state, link, session, first_round_timeout_s=None):
        super().__init__(party, state, link, session, first_round_timeout_s)
        self.ranks: Ranks = party.ranks
        self.speaks = self.ranks.rank == 0

    def _next_control(self, r: int) -> proto.Control | None:
        """Rank 0 receives round ``r``'s control from A and hands it to every
        rank (``END``: the session is over); the others take it."""
        ranks = self.ranks
        if ranks.rank == 0:
            try:
                c = super()._next_control(r)
            except BaseException:
                ranks.broadcast_control()  # the others end it too
                raise
            ranks.broadcast_control(None if c is None else c.tensor())
            return c
        t = ranks.broadcast_control()
        if int(t[0]) == END:
            return None
        return proto.Control.parse(t, self.state.cfg.seq_len)

    def _exchange_norms(self, r: int, mine: float) -> float:
        """Rank 0 exchanges B's squared norm (the ranks' sum) with A and
        hands A's to every rank."""
        theirs = super()._exchange_norms(r, mine) if self.ranks.rank == 0 else 0.0
        return self.ranks.broadcast_float(theirs)

    def _generation_input(self, r: int, count: int) -> torch.Tensor | None:
        """The first stage's input of a generation step on every rank that
        needs one: rank 0's from A; the next stages' from the stage before
        (pipelined), or zeros to run the sharded blocks alongside. None on
        every rank when A's were not finite: the ranks refuse alike."""
        ranks = self.ranks
        shape, dev = (1, count, self.hidden), self.state.device
        x = super()._generation_input(r, count) if ranks.rank == 0 else None
        if not ranks.all_ok(ranks.rank != 0 or x is not None):
            return None
        if ranks.rank == 0:
            return x
        if ranks.sharded:
            return torch.zeros(shape, device=dev)
        x = torch.empty(shape, device=dev)
        dist.recv(x, ranks.rank - 1)
        return x

    def _train(self, r: int, c: proto.Control) -> None:
        self._at_next_step(c, "TRAIN round")  # refused alike on every rank
        if why := self.ranks.problem_with(c.micro_size):
            raise proto.ProtocolError(why)
        self.state.train(True)
        with _out_of_step(f"TRAIN round for step {c.step}"):
            mine = self.ranks.sum_float(self._train_round(r, c))
            theirs = self._exchange_norms(r, mine)
        self._apply_step(c, theirs, mine)

    def _train_round(self, r: int, c: proto.Control) -> float:
        """This rank's work of a TRAIN round; returns its share of B's
        squared gradient norm (NaN: a problem found)."""
        raise NotImplementedError

    @torch.no_grad()
    def _eval(self, r: int, c: proto.Control) -> None:
        self.state.train(False)
        with _out_of_step("EVAL round"):
            self._eval_round(r, c)

    def _eval_round(self, r: int, c: proto.Control) -> None:
        raise NotImplementedError

    def _save(self, r: int, c: proto.Control) -> None:
        self._at_next_step(c, "SAVE")
        with _out_of_step(f"SAVE of step {c.step}"):
            self.party.save_share(self, r, c)


class PipelinedRounds(_RankRounds):
    """The rounds of a compute party whose blocks are pipeline stages, one
    per rank (see the module's docstring)."""

    def __init__(self, party, state, link, session, first_round_timeout_s=None):
        super().__init__(party, state, link, session, first_round_timeout_s)
        self.module = _Stage(self)
        #: a runtime per round shape (its stage's buffers are sized for it)
        self.runtimes: dict[tuple, tuple[_PipelineScheduleRuntime, list]] = {}
        self.round: tuple[int, proto.Control] | None = None

    # --- the pipeline ------------------------------------------------------

    def act_from_link(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage 0's input for micro-batch ``i``: A's activations (a leaf
        whose gradient goes back to A) and document ids."""
        r, c = self.round
        x, doc = self._recv_act_doc(r, i, c)
        if doc is not None:
            doc = doc.to(self.state.device)
        x = self.state.checked(x, f"the activations (micro-batch {i})")
        x = x.to(self.state.device)
        if torch.is_grad_enabled():
            x.requires_grad_()
            x.register_hook(partial(self._gact_to_link, r, i))
        return x, doc

    def _gact_to_link(self, r: int, i: int, g: torch.Tensor) -> None:
        self.link.send("gact", g, step=r, micro=i, codec=self.session.codec)

    def _runtime_for(self, c: proto.Control, train: bool):
        # An evaluation is one micro-batch, its backward skipped (``eval()``).
        order = schedule.make(c.micro_batches, c.window).b if train else EVAL_ORDER
        key = (train, c.micro_batches, c.micro_size, c.seq_len, c.eod, c.window)
        if key not in self.runtimes:
            dev = self.state.device
            h = torch.zeros(c.micro_size, c.seq_len, self.hidden, device=dev)
            h.requires_grad_(train)
            index = torch.zeros(1, dtype=torch.int64, device=dev)
            carried = (h, index)
            if c.eod:
                doc = torch.zeros(c.micro_size, c.seq_len, dtype=torch.int32)
                carried += (doc.to(dev),)
            rank = self.ranks.rank
            stage = PipelineStage(
                self.module,
                rank,
                self.ranks.world,
                dev,
                input_args=(index,) if rank == 0 else carried,
                output_args=(
                    (torch.zeros((), device=dev),)
                    if rank == self.ranks.last
                    else carried
                ),
            )
            runtime = _runtime(stage, self.ranks, order, c.micro_batches)
            self.runtimes[key] = (runtime, order)
        return self.runtimes[key]

    def _run_pipeline(self, r: int, c: proto.Control, train: bool) -> None:
        runtime, order = self._runtime_for(c, train)
        self.round = (r, c)
        m = c.micro_batches
        indices = torch.arange(m, device=self.state.device)
        relay = None
        if self.ranks.rank == 0:
            relay = _Relay(self, r, c, order if train else order[:1])
            relay.start()
        run = runtime.step if train else runtime.eval
        try:
            if self.ranks.rank == 0:
                run(indices, return_outputs=False)
            elif self.ranks.rank == self.ranks.last:
                run(target=indices, return_outputs=False)
            else:
                run(return_outputs=False)
        except BaseException:
            # The relay may wait on the last stage for good: do not wait long.
            if relay is not None:
                relay.join(RELAY_GRACE_S)
            raise
        if relay is not None:
            relay.join()  # it has what the stages sent, and ends with them
            if relay.error is not None:
                raise relay.error

    # --- rounds --------------------------------------------------------------

    def _train_round(self, r: int, c: proto.Control) -> float:
        self._run_pipeline(r, c, train=True)
        return self.state.local_sq_norm()

    def _eval_round(self, r: int, c: proto.Control) -> None:
        self._run_pipeline(r, c, train=False)

    # --- generation: the positions run down the stages, one rank after another

    def _generation_step(self, r: int, x: torch.Tensor, cache) -> None:
        ranks = self.ranks
        with _out_of_step("generation step"):
            y = self.middle(x, cache=cache)
            if ranks.rank != ranks.last:
                dist.send(y.contiguous(), ranks.rank + 1)
            else:
                dist.send(y.contiguous(), 0, group=ranks.relay)
            if ranks.rank == 0:
                out = torch.empty_like(y)
                dist.recv(out, ranks.last, group=ranks.relay)
                self.link.send("out", out, step=r, codec=self.session.codec)


class ShardedRounds(_RankRounds):
    """The rounds of a compute party with more ranks than blocks: B's blocks
    are sharded over all the ranks with FSDP2 (``fully_shard``: each rank
    keeps 1/R of every weight, gradient and AdamW moment, and gathers a
    block's weights only to run it), and every rank runs a contiguous share
    of each micro-batch's rows (``torch.tensor_split``), which rank 0 hands
    out and gathers back.

    Rows are independent through the blocks, so the outputs are a single
    process's. Gradients accumulate unreduced over the step's micro-batches
    and are reduce-scattered once, summed (not averaged: the step's gradient
    is the sum over micro-batches, as A's loss scaling makes it), in the
    step's last backward -- the last in ``split.schedule``'s order whatever
    A's window."""

    def __init__(self, party, state, link, session, first_round_timeout_s=None):
        super().__init__(party, state, link, session, first_round_timeout_s)
        self.sharded = shard_blocks(state, self.ranks.world, state.partition.middle)

    def _rows(self, t: torch.Tensor | None, shape, dtype) -> torch.Tensor:
        return scatter_rows(self.ranks, t, shape, dtype, self.state.device)

    def _gather(self, mine: torch.Tensor, shape) -> torch.Tensor | None:
        return gather_rows(self.ranks, mine, shape)

    def _forward_rows(self, r: int, i: int, c: proto.Control, grad: bool):
        shape = (c.micro_size, c.seq_len, self.hidden)
        x = doc = None
        if self.ranks.rank == 0:
            x, doc = self._recv_act_doc(r, i, c)
            x = self.state.checked(x, f"the activations (micro-batch {i})")
        x = self._rows(x, shape, torch.float32)
        mask = None
        if c.eod:
            doc = self._rows(doc, shape[:2], torch.int32)
            mask, _ = masks_from_documents(doc.to(torch.int64))
        x.requires_grad_(grad)
        with self.state.autocast() if grad else autocast_for(self.state.device):
            y = self.middle(x, mask)
        out = self._gather(y, shape)
        if out is not None:
            self.link.send("out", out, step=r, micro=i, codec=self.session.codec)
        return x, y

    def _train_round(self, r: int, c: proto.Control) -> float:
        shape = (c.micro_size, c.seq_len, self.hidden)
        inflight = {}
        for kind, i in schedule.make(c.micro_batches, c.window).b:
            if kind == "F":
                inflight[i] = self._forward_rows(r, i, c, grad=True)
                continue
            g = None
            if self.ranks.rank == 0:
                g = self.link.recv(
                    "gout", step=r, micro=i, shape=shape, dtype=torch.float32
                )
                self.state.checked(g, f"the gradient of the output ({i})")
            g = self._rows(g, shape, torch.float32)
            x, y = inflight.pop(i)
            last = not inflight and i == c.micro_batches - 1
            for module in self.sharded:  # reduce-scatter in the last one
                module.set_requires_gradient_sync(last, recurse=False)
            torch.autograd.backward(y, g)
            gact = self._gather(x.grad, shape)
            if gact is not None:
                self.link.send("gact", gact, step=r, micro=i, codec=self.session.codec)
        # Each rank holds a shard of every gradient: B's squared norm is the
        # sum of theirs; a problem any rank found makes it NaN.
        return math.nan if self.state.problem else shard_sq_norm(self.state.params)

    def _eval_round(self, r: int, c: proto.Control) -> None:
        self._forward_rows(r, 0, c, grad=False)

    # --- generation: every rank runs the blocks (their weights are gathered
    # block by block), rank 0 on the sequence, the others on zeros

    def _generation_step(self, r: int, x: torch.Tensor, cache) -> None:
        with _out_of_step("generation step"):
            y = self.middle(x, cache=cache)
            if self.ranks.rank == 0:
                self.link.send("out", y, step=r, codec=self.session.codec)

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole of B's tensors, gathered from the shards (every rank
        takes part; rank 0 writes them)."""
        return gathered_tensors(self.state)


class _out_of_step:
    """Turn any failure inside a round into ``RanksOutOfStep``."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, RanksOutOfStep):
            raise RanksOutOfStep(
                f"the compute party's ranks fell out of step in a {self.what}: {exc}"
            ) from exc
        return False


class _Relay(threading.Thread):
    """Rank 0's side of the last stage: its outputs to A, A's gradients back,
    in the order the stage runs them."""

    def __init__(self, rounds, r: int, c: proto.Control, order) -> None:
        super().__init__(name="aisyn-pipeline-relay", daemon=True)
        self.rounds, self.r, self.c, self.order = rounds, r, c, order
        self.error: BaseException | None = None

    def run(self) -> None:
        rounds, r, c = self.rounds, self.r, self.c
        ranks, link, codec = rounds.ranks, rounds.link, rounds.session.codec
        shape = (c.micro_size, c.seq_len, rounds.hidden)
        try:
            for kind, i in self.order:
                if kind == "F":
                    y = torch.empty(shape, device=rounds.state.device)
                    dist.recv(y, ranks.last, group=ranks.relay)
                    link.send("out", y, step=r, micro=i, codec=codec)
                else:
                    g = link.recv(
                        "gout", step=r, micro=i, shape=shape, dtype=torch.float32
                    )
                    g = g.to(rounds.state.device).contiguous()
                    dist.send(g, ranks.last, group=ranks.relay)
        except BaseException as e:  # noqa: BLE001 -- re-raised by the main thread
            self.error = e
            link.abort(f"compute party: {e}")
            # The stages may be waiting on each other for what this relay no
            # longer passes on, until the collectives' timeout: the job ends
            # now if the main thread has not ended it by itself.
            end = threading.Timer(RELAY_GRACE_S, _end_job, [e])
            end.daemon = True
            end.start()


#: how long rank 0 waits, after its relay failed, for the round to end itself
RELAY_GRACE_S = 10.0


def _end_job(e: BaseException) -> None:
    """End this rank (and with it the torchrun job) after a failed relay."""
    print(
        f"aisyn: error: the compute party's ranks fell out of step: the relay to "
        f"the data party failed ({str(e).splitlines()[0] if str(e) else e!r}); "
        "the job ends, its last checkpoint intact",
        file=sys.stderr,
        flush=True,
    )
    os._exit(2)

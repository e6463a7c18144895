"""The torchrun job a compute party runs as: which blocks each rank holds (a
pipeline stage each, or, with more ranks than blocks, FSDP2 shards of all of
them), whether they fit this machine, and rank 0 telling the others which
session to serve and when to stop (``serve_ranks``)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from aisyn.errors import RunFailedError
from aisyn.model.cost import pipeline_stage_blocks
from aisyn.model.families import ModelConfig
from aisyn.model.segments import Partition
from aisyn.split.sharding import (
    IDLE_WAIT,
    RankGroup,
    check_gpus,
)

log = logging.getLogger(__name__)


#: the control word that ends a session on the other ranks
END = -1


class RanksOutOfStep(RunFailedError):
    """A round failed part-way: the ranks cannot agree where they are."""


def stage_blocks(middle: range, ranks: int) -> list[range]:
    """B's middle blocks as ``ranks`` pipeline stages: the planner's rule
    (``model.cost.pipeline_stage_blocks``), numbered as the model's blocks."""
    at = middle.start
    return [
        range(at + r.start, at + r.stop)
        for r in pipeline_stage_blocks(len(middle), ranks)
    ]


@dataclass
class Ranks(RankGroup):
    """The torchrun job a pipelined compute party runs as."""

    #: each rank's blocks: a pipeline stage each, or (``sharded``) all of
    #: them on every rank
    blocks: list[range]
    #: more ranks than blocks: B's blocks are FSDP2-sharded over all the
    #: ranks, each running a share of each micro-batch's rows (``ShardedRounds``)
    sharded: bool
    #: the last stage and rank 0: its outputs to A, A's gradients back
    relay: dist.ProcessGroup

    @classmethod
    def join(
        cls,
        cfg: ModelConfig,
        partition: Partition,
        device: torch.device,
        timeout_s: float,
    ):
        """Join the job torchrun describes, for the cut ``partition`` of a
        model of ``cfg``, once the ranks of this machine are known to fit in
        its memory (weights, gradients and AdamW state, refused before any
        is allocated).

        Up to one rank per block, the blocks are pipeline stages; with more
        ranks than blocks, they are sharded over all of them (FSDP2), each
        rank taking a share of the rows. Every collective between ranks
        times out after ``timeout_s``, except the wait for the next session."""
        from aisyn.train import distributed

        world = distributed.world_size()
        middle = partition.middle
        sharded = world > len(middle)
        blocks = [middle] * world if sharded else stage_blocks(middle, world)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        check_gpus(device, local)
        _check_memory(cfg, partition, blocks, sharded, device)
        ctx, device = distributed.setup(device, timedelta(seconds=timeout_s))
        ctl = dist.new_group(backend="gloo", timeout=IDLE_WAIT)
        relay = dist.new_group([0, world - 1])
        return (
            cls(ctx.rank, world, ctl, blocks=blocks, sharded=sharded, relay=relay),
            device,
        )

    def share(self, partition: Partition) -> Partition:
        """The cut as this rank holds it."""
        if self.sharded:
            return partition
        return partition.rank_share(self.blocks[self.rank])

    def describe(self) -> str:
        if self.sharded:
            return f"blocks sharded over {self.world} ranks (FSDP2), rows shared"
        return f"blocks over {self.world} pipeline stages"

    def problem_with(self, micro_size: int) -> str | None:
        """Why this layout cannot train on micro-batches of ``micro_size``
        rows (an evaluation batch of fewer rows leaves ranks idle, no more)."""
        if self.sharded and micro_size < self.world:
            return (
                f"this compute party shares each micro-batch's rows over its "
                f"{self.world} ranks (more ranks than its {len(self.blocks[0])} "
                f"block(s)), and micro-batches of {micro_size} row(s) would leave "
                f"ranks idle: use --micro-batch-size of at least {self.world}, or "
                f"start it on at most {max(micro_size, len(self.blocks[0]))} ranks"
            )
        return None

    def broadcast_control(self, t: torch.Tensor | None = None) -> torch.Tensor:
        """Rank 0's control tensor (or ``END``) on every rank."""
        if t is None:
            t = torch.full((7,), END, dtype=torch.int64)
        t = t.clone() if self.rank == 0 else torch.empty(7, dtype=torch.int64)
        dist.broadcast(t, 0, group=self.ctl)
        return t


def _check_memory(
    cfg: ModelConfig,
    partition: Partition,
    blocks: list[range],
    sharded: bool,
    device: torch.device,
) -> None:
    """Refuse, with the numbers, ranks whose weights, gradients and AdamW
    state (the planner's per-rank formula at one token; activations come on
    top, with A's batch) do not fit this machine: the host's memory, which
    the ranks on it share (``LOCAL_WORLD_SIZE``), or each rank's GPU."""
    from aisyn.model.capacity import available_bytes, memory_check_skipped
    from aisyn.model.cost import format_bytes
    from aisyn.model.segments import COMPUTE_PARTY
    from aisyn.train.memory import rank_bytes

    if memory_check_skipped():
        return
    # Sharded ranks load B whole before they shard it: each needs the whole.
    stages = 1 if sharded else len(blocks)
    per_stage = rank_bytes(cfg, partition, COMPUTE_PARTY, stages, 1, 1)
    per_rank = per_stage * len(blocks) if sharded else per_stage
    local = int(os.environ.get("LOCAL_WORLD_SIZE", len(blocks)))
    first = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
    here = per_rank[first : first + local]
    needed = sum(here) if device.type == "cpu" else max(here)
    free = available_bytes(device)
    if free is None or needed <= free:
        return
    held = ", ".join(f"h[{b.start}:{b.stop}]" for b in blocks[first : first + local])
    where = f"its {local} rank(s) on this machine" if device.type == "cpu" else "a rank"
    raise ValueError(
        f"the compute party's blocks ({held}) need about {format_bytes(needed)} "
        f"on {device} for {where} (weights, gradients and AdamW state), but only "
        f"{format_bytes(free)} is available: start more ranks (on more machines), "
        "or cut fewer blocks to B"
    )


def serve_ranks(party) -> None:
    """What every rank but 0 of a pipelined compute party does: run each
    session rank 0 announces (its hello, checked again here against this
    rank's disk), until rank 0 says stop."""
    ranks: Ranks = party.ranks
    while True:
        news = ranks.broadcast_json()
        if not isinstance(news, dict) or "hello" not in news:
            return
        _, session = party.negotiate(news["hello"], news["identity"])
        if session.start_step != news["start"]:
            raise RanksOutOfStep(
                f"run {session.run_id}: rank {ranks.rank} would start at step "
                f"{session.start_step}, rank 0 at {news['start']} (a rank's "
                "checkpoints are missing or differ)"
            )
        try:
            party.serve_session(None, session)
        except (ValueError, OSError) as e:  # refused alike on every rank
            log.debug("rank %d: session ended: %s", ranks.rank, e)


def announce_session(ranks: Ranks, session) -> None:
    """Rank 0: tell the other ranks to serve ``session``."""
    ranks.broadcast_json(
        {"hello": session.hello, "identity": session.owner, "start": session.start_step}
    )


def stop_ranks(ranks: Ranks) -> None:
    """Rank 0: the server stops; so do the other ranks."""
    ranks.broadcast_json({"stop": True})

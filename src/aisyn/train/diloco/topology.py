"""Centres of ranks: where a rank of the job stands, and its log lines' label."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from aisyn.train.distributed import DistContext

# --- centres of ranks ------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    """Where a rank stands in a job of centres of ``inner.world`` ranks each
    (the ranks of a centre contiguous, as torchrun numbers a node's).

    ``job``: the whole job; ``inner``: this centre's ranks, DDP's group;
    ``across``: the rank with this one's place in every centre, the group its
    share of the outer exchange crosses the wide-area link in.
    """

    job: DistContext
    inner: DistContext
    across: DistContext

    @property
    def centre(self) -> int:
        return self.across.rank

    @property
    def centres(self) -> int:
        return self.across.world

    def name(self, rank: int) -> str:
        """How a message names job rank ``rank``: its centre (and its rank)."""
        return centre_label(rank, self.inner.world)


def centre_label(rank: int, ranks_per_centre: int) -> str:
    """Job rank ``rank``'s centre (and, in a centre of several, its rank)."""
    per = ranks_per_centre
    return f"centre {rank // per}" + (f" (rank {rank})" if per > 1 else "")


def label_logs(label: str) -> Callable[[], None]:
    """Prefix every log line this process writes with ``label`` (its
    centre): the centres of a job on one machine log to one terminal, in
    either order. Returns what takes the prefix off again."""

    class Label(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if getattr(record, "centre", None) is None:  # once, however many handlers
                record.centre = label
                record.msg = f"{label}: {record.msg}"
            return True

    label_filter = Label()
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(label_filter)

    def remove() -> None:
        for handler in handlers:
            handler.removeFilter(label_filter)

    return remove


def centre_of(rank: int, world: int, ranks_per_centre: int) -> tuple[int, int]:
    """(centre, number of centres) of job rank ``rank`` of ``world``;
    ValueError if the centres cannot all have ``ranks_per_centre`` ranks."""
    if world % ranks_per_centre:
        raise ValueError(
            f"--ranks-per-centre {ranks_per_centre} does not divide the {world} "
            "ranks torchrun started: every centre needs as many ranks"
        )
    return rank // ranks_per_centre, world // ranks_per_centre


def topology(job: DistContext, ranks_per_centre: int) -> Topology:
    """The centres' process groups (every rank of the job calls this, in the
    same order: torch's subgroups need it)."""
    per = ranks_per_centre
    centre, count = centre_of(job.rank, job.world, per)
    if per == 1:  # a centre of one rank: the job's group is the centres'
        return Topology(job, DistContext(), DistContext(job.rank, job.world))
    inner, _ = dist.new_subgroups_by_enumeration(
        [list(range(c * per, (c + 1) * per)) for c in range(count)]
    )
    across, _ = dist.new_subgroups_by_enumeration(
        [[c * per + i for c in range(count)] for i in range(per)]
    )
    place = job.rank % per
    return Topology(
        job,
        DistContext(place, per, job.local_rank, inner),
        DistContext(centre, count, job.local_rank, across),
    )

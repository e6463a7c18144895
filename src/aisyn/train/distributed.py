"""Data-parallel scale-out within one party, via ``torchrun`` and DDP.

``torchrun --nproc-per-node N -m aisyn.cli train ...`` (or across machines with
``--nnodes``/``--rdzv-endpoint``) runs N ranks. Every rank draws the same global
batch from the seeded sampler and keeps its own contiguous share of the rows;
DDP averages gradients, so a step computes what one process would on the whole
batch (equal shares, mean of means). Rank 0 alone writes logs, metrics,
plots and checkpoints. Without ``WORLD_SIZE`` > 1 nothing here does anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from aisyn.errors import RunFailedError


@dataclass(frozen=True)
class DistContext:
    """This rank's place among ``world`` ranks: of torchrun's job, or of
    ``group``, a subgroup of it (a DiLoCo centre's ranks; None: the job's)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of a global batch."""
        if not self.enabled:
            return batch
        per = len(batch) // self.world
        return batch[self.rank * per : (self.rank + 1) * per]

    def mean(self, value: float, device: torch.device) -> float:
        """Average a scalar over ranks (e.g. the logged loss)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=self.group)
        return float(t.item()) / self.world

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)


def under_torchrun() -> bool:
    """Whether torchrun (torch.distributed.elastic) started this process,
    with any number of ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _attempt_store(world: int, timeout: timedelta | None) -> dist.Store | None:
    """The store this attempt's ranks meet in, when torchrun shares its own
    with them (its c10d rendezvous, the default): that store outlives a
    restart of the workers (``--max-restarts``), so the keys an earlier
    attempt's ranks wrote (a killed rank's address) would be read by the
    next attempt's, which then fail to connect (pytorch#135712). A prefix
    per attempt keeps them apart. None: ``env://`` as it is."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timeout or dist.constants.default_pg_timeout,
    )
    return dist.PrefixStore(f"aisyn/attempt_{attempt}", store)


#: the key of this attempt's store that counts the ranks stopped on a
#: one-line error (``claim_stop``)
STOP_KEY = "aisyn-stopped"
#: how long a stopping rank waits for torchrun's store
STOP_STORE_TIMEOUT = timedelta(seconds=5)

# How gloo and NCCL word an operation that failed because another rank of the
# job went away (gloo raises a plain RuntimeError).
_PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Connection refused",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
)


def _stop_store() -> dist.Store | None:
    """The store a job's ranks report their stops in: torchrun's own (its
    agent's, which outlives every rank), this attempt's keys; None when
    there is none (not under torchrun, or a rendezvous without it)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=STOP_STORE_TIMEOUT,
        )
    except (KeyError, ValueError, RuntimeError, dist.DistError):
        return None
    return dist.PrefixStore(f"aisyn/attempt_{attempt}", store)


def claim_stop() -> bool:
    """A rank stops on a one-line error: whether it is the first of its job's
    to (then it prints the line; the others, which stop because it did, stay
    quiet: ``stopped_by_another``). True when no store can tell."""
    store = _stop_store()
    if store is None:
        return True
    try:
        return store.add(STOP_KEY, 1) == 1
    except (RuntimeError, dist.DistError):
        return True


def stopped_by_another() -> bool:
    """Whether another rank of this job has stopped on a one-line error (so
    what this rank failed with -- a peer gone, a collective broken -- is a
    consequence, its reason already printed)."""
    store = _stop_store()
    if store is None:
        return False
    try:
        return store.add(STOP_KEY, 0) > 0
    except (RuntimeError, dist.DistError):
        return False


def peer_lost(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because another rank went
    away (gloo's or NCCL's words for it)."""
    if isinstance(e, dist.DistNetworkError):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_LOST)


def world_size() -> int:
    """Ranks torchrun started (1 when not run under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank of torchrun's (0 when not run under torchrun)."""
    return int(os.environ.get("RANK", "0"))


def setup(
    device: torch.device, timeout: timedelta | None = None
) -> tuple[DistContext, torch.device]:
    """Join the process group torchrun describes; pick this rank's device
    (``timeout``: of its collectives, torch's default when None)."""
    world = world_size()
    if world <= 1:
        return DistContext(), device
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # torch's own default when none is given (passing None explicitly
        # was seen to leave a gloo thread running at exit: SIGABRT)
        extra = {} if timeout is None else {"timeout": timeout}
        try:
            store = _attempt_store(world, timeout)
            if store is not None:
                extra.update(store=store, rank=rank, world_size=world)
            dist.init_process_group(backend, **extra)
        except (RuntimeError, dist.DistError) as e:
            where = (
                f"{os.environ.get('MASTER_ADDR', '?')}:"
                f"{os.environ.get('MASTER_PORT', '?')}"
            )
            waited = "" if timeout is None else f" within {timeout.total_seconds():g} s"
            first = (
                str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            )
            raise RunFailedError(
                f"rank {rank} of {world}: the other ranks did not join at {where}"
                f"{waited} ({first})"
            ) from None
    return DistContext(rank, world, local), device


def teardown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()

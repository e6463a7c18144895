"""What the ranks of one party's torchrun job share, whichever party it is.

A party spread over ranks keeps one of them (rank 0) on the link and drives
the others over ``torch.distributed``:

* ``RankGroup``: the job's ranks and their control group (JSON and small
  tensors broadcast from rank 0; nothing is unpickled);
* ``scatter_rows`` / ``gather_rows``: a micro-batch's rows handed out by rank
  0 and gathered back (``torch.tensor_split``'s shares: rows are independent
  through a transformer's blocks, so each rank may run its own);
* ``shard_blocks``: FSDP2 (``fully_shard``) over a party's blocks, applied
  from outside once its weights are in place, with the optimizer rebuilt over
  the shards; ``shard_sq_norm`` and ``gathered_tensors`` are the norm and the
  checkpoint of such a party.

The compute party's sharded ranks (``split.backbone.pipeline.ShardedRounds``) and the
data party's ranks (``split.client.data_ranks``) are built from these.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from aisyn.model.segments import own_tensor_shapes
from aisyn.train import checkpoint as ckpt
from aisyn.train.fsdp import full, is_sharded, local

#: how long a rank waits for rank 0's next word (rank 0 may idle for days,
#: or validate for hours, while the others wait)
IDLE_WAIT = timedelta(days=365)


@dataclass
class RankGroup:
    """A party's torchrun job: this rank, how many, and the gloo group of
    rank 0's words to the others (CPU tensors, bounded only by ``IDLE_WAIT``)."""

    rank: int
    world: int
    ctl: dist.ProcessGroup

    @property
    def last(self) -> int:
        return self.world - 1

    def check_shared(self, root: Path | None, who: str) -> None:
        """Refuse a folder the ranks do not share: rank 0 alone reads and
        writes the run's record, so on several nodes it must be one shared
        filesystem. ``who``: the party, for the message."""
        if root is None:
            return
        token = self.broadcast_json(uuid.uuid4().hex if self.rank == 0 else None)
        probe = Path(root) / f".aisyn-ranks-{token}"
        ok = True
        if self.rank == 0:
            try:
                probe.parent.mkdir(parents=True, exist_ok=True)
                probe.touch()
            except OSError:
                ok = False
        ok = self.all_ok(ok)
        seen = self.all_ok(ok and probe.is_file())
        if self.rank == 0:
            probe.unlink(missing_ok=True)
        if not seen:
            raise OSError(
                f"--out {root}: the {who}'s ranks do not all see the same "
                "folder (on several nodes it must be one shared filesystem)"
            )

    def broadcast_json(self, obj: object = None) -> object:
        """Rank 0's ``obj`` on every rank, as JSON (nothing is unpickled)."""
        if self.rank == 0:
            data = torch.frombuffer(
                bytearray(json.dumps(obj).encode()), dtype=torch.uint8
            )
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.ctl)
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.ctl)
        return json.loads(bytes(data.numpy()).decode())

    def broadcast_float(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.broadcast(t, 0, group=self.ctl)
        return float(t)

    def sum_float(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.ctl)
        return float(t)

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """Each of ``values`` summed over the ranks (one collective)."""
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, group=self.ctl)
        return t.tolist()

    def all_ok(self, ok: bool) -> bool:
        t = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctl)
        return bool(t)


def check_gpus(device: torch.device, local: int) -> None:
    """Refuse more ranks on a machine (``local``) than it has GPUs."""
    if device.type == "cuda" and local > torch.cuda.device_count():
        raise ValueError(
            f"{local} ranks on this machine, which has "
            f"{torch.cuda.device_count()} GPU(s): one rank per GPU "
            "(torchrun --nproc-per-node at most that)"
        )


# --- rows of a micro-batch ------------------------------------------------------


def row_shares(rows: int, world: int) -> list[range]:
    """Each rank's rows of a micro-batch of ``rows`` (``tensor_split``'s)."""
    return [
        range(int(r[0]), int(r[-1]) + 1) if len(r) else range(0)
        for r in torch.arange(rows).tensor_split(world)
    ]


def scatter_rows(
    group: RankGroup,
    t: torch.Tensor | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Rank 0's ``t`` (of ``shape``) split by rows; this rank's share (rank
    0 sends the others theirs; ``t`` is ignored elsewhere)."""
    if group.rank == 0:
        parts = t.to(device).tensor_split(group.world)
        for k in range(1, group.world):
            dist.send(parts[k].contiguous(), k)
        return parts[0]
    rows = len(row_shares(shape[0], group.world)[group.rank])
    mine = torch.empty((rows, *shape[1:]), dtype=dtype, device=device)
    dist.recv(mine, 0)
    return mine


def gather_rows(
    group: RankGroup, mine: torch.Tensor, shape: Sequence[int]
) -> torch.Tensor | None:
    """The whole of every rank's rows (fp32) on rank 0; None elsewhere."""
    if group.rank != 0:
        dist.send(mine.detach().float().contiguous(), 0)
        return None
    shares = row_shares(shape[0], group.world)
    parts = [mine.detach().float()]
    for k in range(1, group.world):
        part = torch.empty((len(shares[k]), *shape[1:]), device=mine.device)
        dist.recv(part, k)
        parts.append(part)
    return torch.cat(parts)


# --- FSDP2 over a party's blocks ---------------------------------------------------


def shard_blocks(state, world: int, blocks: Sequence[int]) -> list:
    """Shard the blocks ``blocks`` of a party (``split.party.PartyState``)
    over ``world`` ranks with FSDP2, once their weights and optimizer state
    are in place (loaded whole, then split): the optimizer is rebuilt over
    the sharded parameters and its moments split alike. Gradients are
    reduce-scattered as sums (a step's gradient is the sum over its rows'
    shares, as the loss scaling makes it); everything else stays replicated.
    Returns the sharded modules."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from aisyn.train.fsdp import shard_modules
    from aisyn.train.optim import make_optimizer

    mesh = init_device_mesh(state.device.type, (world,))
    moments = {n: state.optimizer.state.get(p, {}) for n, p in state.named}
    layout = state.cfg.layout
    modules = [state.model.get_submodule(layout.block_path(i)) for i in blocks]
    # a sum over the rows' shares
    shard_modules(modules, mesh, state.device.type, gradients="sum")
    params = dict(state.model.named_parameters())
    state.named = [(n, params[n]) for n, _ in state.named]
    state.params = [p for _, p in state.named]
    state.optimizer = make_optimizer(state.named, state.train_cfg)
    for name, p in state.named:
        if moments[name]:
            state.optimizer.state[p] = {
                k: distribute_tensor(v, mesh, p.placements)
                if is_sharded(p) and v.shape == p.shape
                else v
                for k, v in moments[name].items()
            }
    return modules


def shard_sq_norm(params: Sequence[torch.Tensor], *, replicated: bool = True) -> float:
    """This rank's share of the squared gradient norm of ``params``: the
    squares of its shards, plus (``replicated``) those of the gradients
    every rank holds whole -- so that the ranks' shares sum to the norm,
    exactly one rank passes ``replicated``."""
    grads = [
        local(p.grad)
        for p in params
        if p.grad is not None and (replicated or is_sharded(p))
    ]
    if not grads:
        return 0.0
    # per tensor (shard) in its own dtype, as ``train.update.grad_sq_norm``
    # and clip_grad_norm_ take them, squared and summed in float64
    norms = torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads])
    return float(norms.double().pow(2).sum())


def gathered_tensors(state) -> dict[str, dict[str, torch.Tensor]]:
    """A party's whole checkpoint, its sharded tensors gathered one at a time
    (every rank takes part; rank 0 writes them), laid out as
    ``PartyState.tensors`` lays them out."""
    if state.lora:
        weights = {n: full(p.detach()) for n, p in state.named}
    else:
        own = own_tensor_shapes(state.cfg, state.partition, state.party)
        model = state.model.state_dict()
        weights = {n: full(model[n].detach()).contiguous() for n in own}
    names = {p: n for n, p in state.named}
    moments = ckpt.optimizer_tensors(state.optimizer, names)
    return {
        ckpt.MODEL_FILE: weights,
        ckpt.OPTIM_FILE: {
            **{k: full(v) for k, v in moments.items()},
            **ckpt.rng_tensors(),
        },
    }

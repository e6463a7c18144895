"""FSDP2 over a data-parallel job's whole model (``--data-parallel fsdp``).

DDP keeps a whole replica of the weights, gradients and AdamW moments on
every rank; a model of tens of billions of parameters does not fit one
device that way. ``fully_shard`` (torch's FSDP2) keeps each rank's dim-0
chunk of every tensor instead and gathers a block's weights only while it
runs: each block is its own unit (one all-gather ahead of it, one
reduce-scatter of its gradients behind it), the embedding, the head and the
rest of the model the root's.

It is applied from outside, as torchtitan does: the model is built and
loaded whole-shaped, then sharded; the optimizer is built over the shards.
Checkpoints are the same files DDP and one process write -- every tensor
whole, gathered one at a time, written by rank 0 -- so a run may resume
under either, on any number of ranks, and ``aisyn eval`` reads it as any
other.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from aisyn.train import checkpoint as ckpt


def shard_model(root: nn.Module, model: nn.Module, group=None) -> None:
    """Shard ``model``'s blocks, then ``root`` (the module whose forward the
    step calls, ``model`` inside it) over the ranks of ``group`` (None: the
    job's), in place."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    device = next(model.parameters()).device
    if group is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    else:
        mesh = DeviceMesh.from_group(group, device.type)
    layout = model.config.layout
    units = [
        model.get_submodule(layout.block_path(i)) for i in range(layout.num_blocks)
    ]
    shard_modules([*units, root], mesh, device.type, gradients="mean")


def shard_modules(modules, mesh, device_type: str, *, gradients: str) -> None:
    """``fully_shard`` each of ``modules`` (inner ones first) over ``mesh``:
    the one FSDP2 applier, for a whole model's data-parallel ranks and a
    split party's ranks alike. ``gradients``: ``"mean"`` over the ranks (what
    DDP takes) or ``"sum"`` (a split step's gradient: the sum over its rows'
    shares, the loss scaling making it the mean)."""
    from torch.distributed.fsdp import fully_shard

    if gradients not in ("mean", "sum"):
        raise ValueError(f"gradients: 'mean' or 'sum', not {gradients!r}")
    for module in modules:
        fully_shard(module, mesh=mesh)
        if gradients == "sum":
            module.set_gradient_divide_factor(1.0)
        if gradients == "sum" or device_type == "cpu":
            # gloo has neither an AVG reduce-scatter nor PREMUL_SUM: a sum,
            # which FSDP2 then divides by its factor (the ranks, or 1)
            module.set_force_sum_reduction_for_comms(True)


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself if it is not sharded)."""
    return t.to_local() if is_sharded(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t``, gathered from every rank if it is sharded (every
    rank must ask, in the same order)."""
    return t.full_tensor() if is_sharded(t) else t


def full_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], keep: bool
) -> dict[str, torch.Tensor]:
    """Each of ``tensors`` whole, gathered one at a time; kept in host
    memory (``keep``: the rank that writes them, which so holds the whole
    checkpoint there, never on its device) or dropped at once, so that no
    other rank holds more than one whole tensor."""
    out = {}
    for name, t in tensors:
        whole = full(t.detach())
        if keep:
            out[name] = whole.cpu().contiguous()
    return out


def like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``value`` (whole) as ``target`` holds it: this rank's shard of it when
    ``target`` is sharded and of its shape, ``value`` otherwise. No
    communication: every rank read the whole tensor."""
    if not is_sharded(target) or value.shape != target.shape:
        return value.to(target.device)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        value.to(target.device),
        target.device_mesh,
        target.placements,
        src_data_rank=None,
    )


@torch.no_grad()
def load_weights(
    model: nn.Module, tensors: dict[str, torch.Tensor], source: str
) -> None:
    """``checkpoint.load_weights`` for a sharded model: the same checks, and
    each rank keeps its shard of every tensor (``expected``'s are detached
    views of the parameters' shards)."""
    expected = ckpt.check_weights(model, tensors, source)
    for name, t in expected.items():
        local(t).copy_(local(like(tensors[name], t)))


def load_optimizer(
    optimizer: torch.optim.Optimizer,
    named: dict[str, nn.Parameter],
    tensors: dict[str, torch.Tensor],
    source: str,
) -> None:
    """``checkpoint.load_optimizer_tensors`` for sharded parameters: each
    moment as its parameter is sharded."""
    ckpt.load_optimizer_tensors(optimizer, named, tensors, source)
    for p, state in optimizer.state.items():
        for key, value in state.items():
            state[key] = like(value, p)


def whole_flat(mine: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """``mine`` -- this rank's shards of ``params``, flat and in order --
    as the whole tensors, flat and in order, gathered one at a time (every
    rank must ask)."""
    from torch.distributed.tensor import DTensor

    parts, offset = [], 0
    for p in params:
        shard = local(p)
        piece = mine[offset : offset + shard.numel()].view(shard.shape)
        offset += shard.numel()
        if is_sharded(p):
            piece = DTensor.from_local(
                piece, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            ).full_tensor()
        parts.append(piece.reshape(-1))
    return torch.cat(parts)


def shard_flat(whole: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """``whole_flat``'s inverse: this rank's shards of the flat whole
    tensors ``whole``, flat and in order (no communication)."""
    parts, offset = [], 0
    for p in params:
        piece = whole[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
        parts.append(local(like(piece, p)).reshape(-1))
    return torch.cat(parts)

"""B's checkpoints when its blocks were spread over the ranks of a pipeline.

Each rank saves its share as an ordinary checkpoint (``train.checkpoint.save``)
in a folder of its own: rank 0 in the run's ``checkpoints/`` -- its state.json
records the world size -- and rank k in ``ranks/<k>/checkpoints/``. A step
exists only when every rank that saved it did (``complete_steps``), so a rank
killed while saving leaves the previous step the one to resume. Any world size
resumes any other's, one process included: a rank reads the tensors of its own
blocks from whichever files hold them, by name (parameter names are the whole
model's, so shares merge by plain union, as the two parties' do).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from aisyn.train import checkpoint as ckpt

#: the key of rank 0's state.json naming how many ranks saved the step
WORLD = "world_size"
#: the folder of a run holding ranks 1.. 's checkpoints
RANKS = "ranks"
#: the prefix of the RNG states in an optimizer file (``ckpt.rng_tensors``)
RNG = "rng."
#: no pipeline is this deep; a larger number in a state.json is refused
MAX_WORLD = 4096


def rank_root(checkpoints: Path, rank: int) -> Path:
    """Where rank ``rank`` of a run whose rank 0 saves in ``checkpoints``
    keeps its checkpoints."""
    if rank == 0:
        return checkpoints
    return checkpoints.parent / RANKS / str(rank) / checkpoints.name


def saved_world(state: dict, folder: Path) -> int:
    """How many ranks saved the checkpoint whose rank-0 state is ``state``."""
    world = state.get(WORLD, 1)
    if type(world) is not int or not 1 <= world <= MAX_WORLD:
        raise ckpt.CheckpointError(
            f"{folder}: {WORLD} {world!r} is not a number of ranks (1..{MAX_WORLD})"
        )
    return world


def shard_folders(folder: Path) -> list[Path]:
    """The step folders of every rank that saved rank 0's step ``folder``."""
    world = saved_world(ckpt.read_state(folder), folder)
    checkpoints = folder.parent
    return [rank_root(checkpoints, k) / folder.name for k in range(world)]


def complete_steps(checkpoints: Path) -> list[int]:
    """The steps every rank that saved them has complete (oldest first)."""
    steps = []
    for step in ckpt.complete_steps(checkpoints):
        folder = ckpt.step_folder(checkpoints, step)
        try:
            shards = shard_folders(folder)
        except ckpt.CheckpointError:
            continue  # an unreadable state: not a step to resume
        if all((s / ckpt.STATE_FILE).is_file() for s in shards[1:]):
            steps.append(step)
    return steps


def missing_files(folder: Path) -> list[Path]:
    """The model and optimizer files of step ``folder`` that are not there."""
    return [
        shard / name
        for shard in shard_folders(folder)
        for name in (ckpt.MODEL_FILE, ckpt.OPTIM_FILE)
        if not (shard / name).is_file()
    ]


def read_share(
    folder: Path,
    file: str,
    wanted: Callable[[str], bool],
    every: set[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors whose names are ``wanted`` from file ``file`` of every
    rank's share of step ``folder``; each must be in exactly one share (the
    RNG states, one per rank, are left out: ``rank_rng``). ``every``: all the
    names the shares must hold together (no more, no fewer), checked from the
    files' headers before any tensor is read."""
    out: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    for shard in shard_folders(folder):
        path = shard / file
        if not path.is_file():
            raise ckpt.CheckpointError(f"{path}: missing")
        with ckpt.opened(path) as f:
            keys = {k for k in f.keys() if not k.startswith(RNG)}
            if twice := sorted(keys & seen):
                raise ckpt.CheckpointError(
                    f"{path}: {twice[0]} is also in another rank's share"
                )
            seen |= keys
            for name in sorted(filter(wanted, keys)):
                out[name] = f.get_tensor(name)
    if every is not None and seen != every:
        odd = sorted(seen ^ every)
        raise ckpt.CheckpointError(
            f"{folder}: its shares of {file} hold {len(seen)} tensors, not the "
            f"{len(every)} of this party ({odd[0]} differs)"
        )
    return out


def rank_rng(folder: Path, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s RNG states saved with step ``folder``, when the step was
    saved by as many ranks as now run it (otherwise none: the ranks' streams
    are not the same streams under another split of the blocks)."""
    shards = shard_folders(folder)
    if len(shards) != world:
        return {}
    path = shards[rank] / ckpt.OPTIM_FILE
    with ckpt.opened(path) as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(RNG)}

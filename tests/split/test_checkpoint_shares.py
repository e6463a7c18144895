"""A pipelined compute party's checkpoint shares: which steps exist, reading a
rank's share by name from any world size's files, and the files that lie."""

from __future__ import annotations

import json

import pytest
import torch

from aisyn.model.pangu import PanguConfig
from aisyn.model.segments import COMPUTE_PARTY, Partition
from aisyn.split.backbone import shards
from aisyn.split.backbone.ranks import _check_memory, stage_blocks
from aisyn.split.party import PartyState
from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig

CFG = PanguConfig(
    vocab_size=64, hidden_size=16, num_layers=6, num_heads=2, ffn_size=32, seq_len=8
)
WHOLE = Partition(CFG.layout, 1, 1)  # B: h[1:4]
TRAIN = TrainConfig(steps=2, batch_size=2, seed=3, device="cpu")


def party(blocks: range | None = None) -> PartyState:
    part = WHOLE if blocks is None else WHOLE.rank_share(blocks)
    return PartyState(CFG, part, COMPUTE_PARTY, TRAIN, torch.device("cpu"))


def save_shares(root, step: int, world: int) -> list[PartyState]:
    """Step ``step`` saved by ``world`` pipeline ranks under ``root``."""
    states = [party(b) for b in stage_blocks(WHOLE.middle, world)]
    for rank, st in enumerate(states):
        state = {"party": "B", **({shards.WORLD: world} if rank == 0 else {})}
        ckpt.save(shards.rank_root(root, rank), step, st.tensors(), state)
    return states


def test_a_step_counts_once_every_rank_that_saved_it_has(tmp_path):
    root = tmp_path / "checkpoints"
    save_shares(root, 5, 3)
    assert shards.complete_steps(root) == [5]
    # rank 2 killed while saving step 10: rank 0's is there, rank 2's is not
    save_shares(root, 10, 3)
    (shards.rank_root(root, 2) / "step_00000010" / ckpt.STATE_FILE).unlink()
    assert shards.complete_steps(root) == [5]


@pytest.mark.parametrize("saved,loaded", [(3, 2), (2, 3), (1, 3), (3, 1)])
def test_any_world_size_reads_any_others_shares(tmp_path, saved, loaded):
    root = tmp_path / "checkpoints"
    if saved == 1:
        whole = party()
        ckpt.save(root, 4, whole.tensors(), {"party": "B"})
        want = whole.tensors()[ckpt.MODEL_FILE]
    else:
        want = {}
        for st in save_shares(root, 4, saved):
            want |= st.tensors()[ckpt.MODEL_FILE]
    folder = ckpt.step_folder(root, 4)
    for rank, blocks in enumerate(stage_blocks(WHOLE.middle, loaded)):
        st = party(None if loaded == 1 else blocks)
        st.load(folder, rank=rank, world=loaded)
        for name, t in st.tensors()[ckpt.MODEL_FILE].items():
            assert torch.equal(t, want[name]), name


def test_a_tensor_in_two_shares_is_refused(tmp_path):
    root = tmp_path / "checkpoints"
    states = save_shares(root, 4, 2)
    # rank 1's share also claims one of rank 0's tensors
    extra = next(iter(states[0].tensors()[ckpt.MODEL_FILE].items()))
    files = states[1].tensors()
    files[ckpt.MODEL_FILE] = {**files[ckpt.MODEL_FILE], extra[0]: extra[1]}
    ckpt.save(shards.rank_root(root, 1), 4, files, {"party": "B"})
    with pytest.raises(ckpt.CheckpointError, match="also in another rank's share"):
        party(range(1, 3)).load(ckpt.step_folder(root, 4), rank=0, world=2)


def test_a_share_missing_a_tensor_is_refused(tmp_path):
    root = tmp_path / "checkpoints"
    states = save_shares(root, 4, 2)
    files = states[1].tensors()
    files[ckpt.MODEL_FILE] = dict(list(files[ckpt.MODEL_FILE].items())[1:])
    ckpt.save(shards.rank_root(root, 1), 4, files, {"party": "B"})
    with pytest.raises(ckpt.CheckpointError, match="not the .* of this party"):
        party(range(1, 3)).load(ckpt.step_folder(root, 4), rank=0, world=2)


@pytest.mark.parametrize("world", [0, -1, 10**9, "2", 2.0, None])
def test_a_world_size_that_is_not_one_is_refused(tmp_path, world):
    root = tmp_path / "checkpoints"
    save_shares(root, 4, 2)
    state = ckpt.step_folder(root, 4) / ckpt.STATE_FILE
    record = json.loads(state.read_text())
    state.write_text(json.dumps({**record, shards.WORLD: world}))
    with pytest.raises(ckpt.CheckpointError, match="is not a number of ranks"):
        party(range(1, 3)).load(ckpt.step_folder(root, 4), rank=0, world=2)
    assert shards.complete_steps(root) == []  # not a step to resume


def test_ranks_that_cannot_fit_are_refused_with_the_numbers(monkeypatch):
    monkeypatch.setattr("aisyn.model.capacity.available_bytes", lambda _d: 1e6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    blocks = stage_blocks(WHOLE.middle, 2)
    with pytest.raises(
        ValueError, match=r"\(h\[1:3\], h\[3:4\]\) need about .* on cpu"
    ):
        _check_memory(CFG, WHOLE, blocks, False, torch.device("cpu"))
    monkeypatch.setattr("aisyn.model.capacity.available_bytes", lambda _d: 1e12)
    _check_memory(CFG, WHOLE, blocks, False, torch.device("cpu"))

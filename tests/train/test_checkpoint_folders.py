"""Checkpoint folders: one naming rule (train.checkpoint) for every party."""

from __future__ import annotations

import pytest
import torch

from aisyn.train import checkpoint as ckpt


def test_complete_steps_lists_only_finished_checkpoints(tmp_path):
    # Prepare: three saved steps, one interrupted mid-write, one foreign folder
    root = tmp_path / "checkpoints"
    w = {"model.safetensors": {"w": torch.zeros(2)}}
    saved = [ckpt.save(root, step, w, {}, keep=0) for step in (1, 2, 30)]
    ckpt.step_folder(root, 40).mkdir()  # no state.json: a crash mid-write
    (root / "step_latest").mkdir()
    # Execute / Assert
    assert ckpt.complete_steps(root) == [1, 2, 30]
    assert saved == [ckpt.step_folder(root, s) for s in (1, 2, 30)]
    assert ckpt.step_folder(root, 30).name == "step_00000030"
    assert ckpt.latest(root) == saved[-1]
    assert ckpt.complete_steps(tmp_path / "none") == []


def test_a_hostile_state_file_is_one_line_not_a_parser_crash(tmp_path):
    """state.json may come with a base model from another organisation: one
    nested to exhaust the parser, or not an object at all, is refused in one
    line naming the file; a folder without one is not a checkpoint."""
    import pytest

    folder = tmp_path / "step_00000001"
    folder.mkdir()
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint"):
        ckpt.read_state(folder)
    (folder / ckpt.STATE_FILE).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ckpt.CheckpointError, match="state.json: nested deeper"):
        ckpt.read_state(folder)
    (folder / ckpt.STATE_FILE).write_text("[1, 2]")
    with pytest.raises(ckpt.CheckpointError, match="state.json"):
        ckpt.read_state(folder)
    (folder / ckpt.STATE_FILE).write_text('{"step": 3}')
    assert ckpt.read_state(folder) == {"step": 3}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.zeros(3, 5), r"exp_avg has shape \(3, 5\), its parameter \(4, 2\)"),
        (torch.full((4, 2), float("nan")), "exp_avg is not finite"),
    ],
    ids=["shape", "nan"],
)
def test_bad_optimizer_state_is_one_line(value, message):
    """Moments of another shape, or NaN, from a file not written here: one
    line naming the tensor, and the optimizer keeps its state."""
    p = torch.nn.Parameter(torch.zeros(4, 2))
    opt = torch.optim.AdamW([p])
    tensors = {"w::step": torch.tensor(1.0), "w::exp_avg": value}
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.load_optimizer_tensors(opt, {"w": p}, tensors, "f.safetensors")
    assert not opt.state

"""Checkpoint folders: one naming rule (train.checkpoint) for every party."""

from __future__ import annotations

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

"""``--resume`` and ``--resume auto``: which folder they look at, and what
they do with an empty one."""

from __future__ import annotations

import json

import pytest

from aisyn.cli import build_parser
from aisyn.train.flags import resume_from_args, sync_from_args


def args_of(*argv: str):
    return build_parser().parse_args(["train", "--data", "d", *argv])


def with_config(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"command": "train"}))


def test_plain_resume_needs_a_run_and_auto_starts_one(tmp_path):
    out = tmp_path / "run"
    assert not resume_from_args(args_of("--out", str(out)), None)
    with pytest.raises(ValueError, match="nothing to resume"):
        resume_from_args(args_of("--out", str(out), "--resume"), None)
    assert not resume_from_args(args_of("--out", str(out), "--resume", "auto"), None)
    with_config(out)
    assert resume_from_args(args_of("--out", str(out), "--resume"), None)
    assert resume_from_args(args_of("--out", str(out), "--resume", "auto"), None)


def test_a_centre_looks_in_its_own_folder(tmp_path, monkeypatch):
    """Centre 1 on a machine of its own holds ``OUT/centres/1`` alone: its
    ``--resume auto`` goes by that folder, not by centre 0's run
    (``OUT/config.json``). (Its plain ``--resume`` is checked once the
    centres have met: tests/train/test_diloco.py.)"""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "run"
    with_config(out)  # centre 0's folder only
    args = args_of("--out", str(out), "--sync", "diloco", "--resume", "auto")
    assert not resume_from_args(args, sync_from_args(args))
    with_config(out / "centres" / "1")
    assert resume_from_args(args, sync_from_args(args))

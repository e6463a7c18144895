"""Federated commands run from a virtualenv that is not activated.

As cron, systemd or pipx run them: the venv's ``bin`` is not on ``PATH``, yet
Flower's SuperLink starts ``flower-superexec`` by name.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from aisyn.procs import child_env, interpreter_bin


def test_children_get_this_interpreters_folder_first_on_path():
    env = child_env({"PATH": "/usr/bin:/bin", "HOME": "/h"}, FLWR_HOME="/f")
    assert env["PATH"].split(os.pathsep) == [interpreter_bin(), "/usr/bin", "/bin"]
    assert env["HOME"] == "/h" and env["FLWR_HOME"] == "/f"
    # not resolved: a venv's python is a symlink out of the venv
    assert interpreter_bin() == str(Path(sys.executable).parent)


def test_an_already_first_folder_is_not_repeated():
    here = interpreter_bin()
    env = child_env({"PATH": os.pathsep.join([here, "/bin", here])})
    assert env["PATH"].split(os.pathsep) == [here, "/bin"]


def test_flower_processes_get_the_interpreters_folder(tmp_path, monkeypatch):
    from aisyn.fl.runtime import flower_env

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    env = flower_env(tmp_path / "home")
    assert env["PATH"].split(os.pathsep)[0] == interpreter_bin()


@pytest.mark.slow  # ~1 min: a whole (one-step) federated run in fresh processes
def test_fl_simulate_by_absolute_path_without_the_venv_on_path(
    base_run, sft_dirs, tmp_path
):
    import subprocess

    # Prepare: the environment of a cron job: no venv on PATH, none activated
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    }
    aisyn = Path(sys.executable).parent / "aisyn"
    cmd = [str(aisyn), "fl", "simulate", "--base", str(base_run)]
    cmd += [f"--client={name}={path}" for name, path in sft_dirs.items()]
    cmd += ["--out", str(tmp_path / "run"), "--rounds", "1", "--local-steps", "1"]
    cmd += ["--batch-size", "4", "--eval-items", "8", "--round-timeout", "120"]
    # Execute
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    # Assert: the run finished (before: "superlink exited with code 3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "server" / "result.json").is_file()

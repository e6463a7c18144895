"""``bench/device_check.sh`` (issue 37, item 16): on a box without a GPU it
says it skipped the device, runs every figure's bench at tiny sizes on the
CPU, and ends with one summary line per figure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "device_check.sh"


def device_check(*args: str, timeout: float) -> tuple[int, list[str]]:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    return done.returncode, done.stdout.splitlines()


needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="bash")


@pytest.mark.heavy
@needs_bash
def test_without_a_gpu_it_says_so_and_checks_the_plumbing():
    rc, lines = device_check("--only", "split", timeout=600)
    assert rc == 0, lines[-10:]
    assert lines[0].startswith("device_check: no CUDA device here: skipped the device")
    summary = lines[lines.index(next(x for x in lines if " logs in " in x)) + 1 :]
    split = [x for x in summary if x.startswith("split: ")]
    assert [("lockstep" in x, "pipelined" in x) for x in split] == [
        (True, False),
        (False, True),
    ]
    assert all(" of paired baseline " in x for x in split)
    assert len(summary) == 2  # nothing but the figure asked for


@needs_bash
def test_a_bad_argument_is_one_line():
    rc, _ = device_check("--gpus", timeout=60)
    assert rc == 2


@needs_bash
@pytest.mark.slow
def test_every_figure_has_its_summary_line_in_cpu_mode():
    rc, lines = device_check("--cpu", timeout=1200)
    assert rc == 0, lines[-10:]
    figures = [x.split(":")[0] for x in lines if not x.startswith("device_check")]
    assert figures == ["train", "split", "split", "link", "tenants"]
    assert any(x.startswith("train: train tiny on cpu: ours ") for x in lines)
    assert any(x.startswith("link: gpu: link from the GPU ") for x in lines)
    assert any(x.startswith("tenants: memory with 2 tenants: ") for x in lines)

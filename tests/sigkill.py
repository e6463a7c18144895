"""Start a command in its own process group and kill the group with SIGKILL
once a file appears: how the resume tests stop a run mid-way."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def kill_once(cmd: list[str], appears: Path, timeout: float = 300) -> None:
    """Run ``cmd``; SIGKILL its whole process group as soon as ``appears``
    exists (a run's first checkpoint). Fails if the run ends first or
    nothing appears within ``timeout`` seconds."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not appears.is_file():
            assert proc.poll() is None, f"{cmd[1]} ended before {appears.name} appeared"
            assert time.monotonic() < deadline, f"no {appears} in {timeout:g} s"
            time.sleep(0.05)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone already
            pass
        proc.wait(30)

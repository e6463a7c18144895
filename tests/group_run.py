"""Run a command that starts processes of its own -- torchrun's agent and its
ranks -- to its end, in a process group of its own.

``subprocess.run(timeout=...)`` kills only the process it started: a torchrun
agent killed that way leaves its ranks behind, still holding ports, memory
and CPU for the tests after it. Here the whole group is killed, on a timeout
and after a normal end alike (a rank that outlived its agent)."""

from __future__ import annotations

import os
import signal
import subprocess


def run_group(
    cmd: list[str], *, timeout: float, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``cmd`` to its end, its output captured as text; every process of its
    group ended by the time this returns (TimeoutExpired after ``timeout``)."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group has ended already
            pass
        if proc.poll() is None:
            proc.wait(30)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

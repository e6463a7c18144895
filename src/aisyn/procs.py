"""The processes the project starts: their environment, start, readiness, stop.

Every long-running child (Flower's SuperLink and SuperNodes, a compute party
spawned by ``aisyn split train --spawn-backbone``) is a :class:`ChildProcess`:
started in its own process group with :func:`child_env` and its output in a log
file, awaited with :meth:`ChildProcess.wait_ready`, and stopped by its PID's
group, SIGTERM first, SIGKILL after a grace period, so that its own children
(Flower's SuperExec and App processes) stop with it.

Run from a virtualenv that is not activated (``/path/to/venv/bin/aisyn ...``, as
cron, systemd or pipx do), ``PATH`` does not hold the venv's ``bin`` folder, so a
child that starts a console script by name — Flower's SuperLink spawns
``flower-superexec``, SuperExec spawns ``flwr-serverapp`` / ``flwr-clientapp`` —
does not find it, or finds another installation's. Putting this interpreter's
own folder first makes every child see the same installation as the parent.

The folder is ``sys.executable``'s parent as written, not resolved: in a venv
``bin/python`` is a symlink to the base interpreter, whose folder has none of the
venv's scripts.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def interpreter_bin() -> str:
    """The folder of this interpreter (a venv's ``bin``), where its scripts are."""
    return str(Path(sys.executable).parent)


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) plus ``extra``, with this
    interpreter's folder first on ``PATH``."""
    env = dict(os.environ if base is None else base)
    env.update(extra)
    here = interpreter_bin()
    rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != here]
    env["PATH"] = os.pathsep.join([here, *rest])
    return env


class ChildExitedError(OSError):
    """A started process ended before it was ready."""


class ChildProcess:
    """A process started in its own process group, its output in ``log_path``.

    ``env`` defaults to :func:`child_env`; a caller that needs more variables
    passes ``child_env(...)`` with them.
    """

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.debug("starting %s: %s", name, " ".join(cmd))
        with self.log_path.open("ab") as out:  # the child keeps its own handle
            self.popen = subprocess.Popen(
                list(cmd),
                env=dict(child_env() if env is None else env),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout_s: float | None = None) -> int:
        """Its exit status, once it exits (``subprocess.TimeoutExpired`` after
        ``timeout_s``)."""
        return self.popen.wait(timeout_s)

    def tail(self, lines: int = 5) -> str:
        """The last ``lines`` lines of its log, on one line."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " | ".join(t.strip() for t in text[-lines:] if t.strip())

    def wait_ready(
        self, ready: Callable[[], bool], timeout_s: float, poll_s: float = 0.05
    ) -> None:
        """Poll ``ready()`` until it is true. A child that exits first
        (:class:`ChildExitedError`) or is not ready within ``timeout_s``
        (``TimeoutError``) is stopped, so that no caller can leave it running."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not self.alive():
                self.stop()
                raise ChildExitedError(
                    f"{self.name} exited with status {self.popen.returncode}: "
                    f"{self.tail() or '(no output)'} (log: {self.log_path})"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"{self.name} was not ready within {timeout_s:g} s "
                    f"(log: {self.log_path})"
                )
            time.sleep(poll_s)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM its process group, then SIGKILL what is left of the group
        after ``grace_s`` (its children too); nothing once it has been reaped."""
        try:
            pgid = os.getpgid(self.popen.pid)  # before the wait reaps the leader
        except ProcessLookupError:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass
        if self.popen.poll() is None:
            log.warning("%s (pid %d) did not exit", self.name, self.popen.pid)

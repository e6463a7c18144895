"""The processes the project starts: their environment, start, readiness, stop.

Every long-running child (Flower's SuperLink and SuperNodes, a compute party
spawned by ``aisyn split train --spawn-backbone``) is a :class:`ChildProcess`:
started in its own process group with :func:`child_env` and its output in a log
file, awaited with :meth:`ChildProcess.wait_ready`, and stopped by its PID's
group, SIGTERM first, SIGKILL after a grace period, so that its own children
(Flower's SuperExec and App processes) stop with it. On Linux it also gets
SIGTERM from the kernel when the thread that started it ends: a parent killed
with SIGKILL runs no cleanup, and its children would otherwise run on (a
spawned compute party holding its port and memory, SuperNodes still polling).

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

import ctypes
import logging
import os
import shutil
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


#: what a child runs first on Linux: ask for SIGTERM when its parent (thread)
#: ends -- the setting survives exec -- give up if the parent is already gone,
#: then become the command (same PID, nothing left in between)
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('its parent ended before it started')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def end_with_parent() -> None:
    """Ask for SIGTERM when this process's parent ends (Linux; elsewhere
    nothing): for a rank of a torchrun job, which must not outlive its agent
    -- killed with ``kill -9``, the agent cannot stop its workers, and each
    would go on holding its share of the model (and its GPU)."""
    if sys.platform != "linux":
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PDEATHSIG
    if os.getppid() != parent:  # it ended before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


#: the signal that asked this command to end, once one has (end_on_sigterm)
_ended_by: int | None = None


def end_on_sigterm() -> None:
    """Make SIGTERM end the command like Ctrl-C does: a ``SystemExit(128 +
    signal)`` raised where the command is, so that its ``finally`` blocks stop
    the processes it started (Flower's SuperLink and SuperNodes, a spawned
    compute party) instead of leaving them running. Each command starts with
    no signal recorded (commands run in one process, as the tests run them,
    do not inherit an earlier one's)."""
    global _ended_by
    _ended_by = None
    signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum, frame) -> None:
    global _ended_by
    _ended_by = signum
    raise SystemExit(128 + signum)


def terminated() -> int | None:
    """The signal that asked this process to end, if one has. The
    ``SystemExit`` it raised may reach its catcher as another error: raised
    while a C extension initialises (matplotlib's first import, say), it
    surfaces as ``ImportError: initialization failed``."""
    return _ended_by


def exit_rank(code: int) -> None:
    """End a torchrun rank now, with ``code``, once its output is flushed,
    without the interpreter's teardown. Two-rank jobs whose work was done
    were seen to abort there now and then (``terminate called without an
    active exception``, SIGABRT, in 1 of about 30 CI runs): a thread of
    torch's distributed backend still joinable while static destructors
    run. torchrun then reports the job failed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def dying_with_parent(cmd: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """``cmd``, run so that it ends with this process (Linux; elsewhere as
    it is). Its program is looked up on ``env``'s PATH here, so that a missing
    one is still this call's FileNotFoundError, not a child's exit."""
    if sys.platform != "linux":
        return list(cmd)
    if shutil.which(cmd[0], path=env.get("PATH")) is None:
        raise FileNotFoundError(f"{cmd[0]}: no such program on PATH")
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


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
        env = dict(child_env() if env is None else env)
        with self.log_path.open("ab") as out:  # the child keeps its own handle
            self.popen = subprocess.Popen(
                dying_with_parent(cmd, env),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        # its group's id, kept: a leader that died (killed, crashed) and was
        # reaped leaves its children in the group, and they must still end
        self.pgid = self.popen.pid

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
        after ``grace_s`` (its children too, even when it died before them);
        nothing once the whole group is gone."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                if self.popen.poll() is not None:
                    return  # nobody is left in the group
            try:
                self.popen.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass
        if self.popen.poll() is None:
            log.warning("%s (pid %d) did not exit", self.name, self.popen.pid)

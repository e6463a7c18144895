"""aisyn.procs.ChildProcess: the one way the project starts, awaits and stops
its long-running children (Flower's processes, a spawned compute party)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from aisyn.procs import ChildExitedError, ChildProcess, child_env, interpreter_bin


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _with_grandchild(tmp_path, name: str) -> tuple[ChildProcess, Path]:
    """A child that starts a sleeping grandchild (its pid in the returned
    file), says "up" and sleeps; returned once it is ready."""
    ready, grandchild = tmp_path / "ready", tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time, pathlib;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"pathlib.Path({str(grandchild)!r}).write_text(str(p.pid));"
        f"pathlib.Path({str(ready)!r}).write_text('ok'); print('up', flush=True);"
        "time.sleep(60)"
    )
    child = ChildProcess(name, _python(code), tmp_path / "log" / "child.log")
    child.wait_ready(ready.is_file, timeout_s=30)
    return child, grandchild


@pytest.mark.heavy
def test_ready_then_stopped_with_its_children(tmp_path):
    # Prepare: a child that starts a grandchild, then says it is ready
    # Execute
    child, grandchild = _with_grandchild(tmp_path, "sleeper")
    assert child.alive()
    child.stop(grace_s=5)
    # Assert: it and its own child are gone; its output went to the log
    assert child.returncode is not None
    pid = int(grandchild.read_text())
    for _ in range(100):
        if _gone(pid):
            break
        time.sleep(0.05)
    assert _gone(pid)
    assert "up" in child.tail()
    child.stop()  # stopping twice is harmless


def test_the_children_of_a_child_killed_first_are_stopped_too(tmp_path):
    # Prepare: a child (say a Flower SuperLink) that starts a grandchild (its
    # ServerApp), then dies by SIGKILL and is reaped: the grandchild lives on
    # in its group
    child, grandchild = _with_grandchild(tmp_path, "leader")
    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)
    pid = int(grandchild.read_text())
    assert not _gone(pid)
    # Execute
    child.stop(grace_s=5)
    # Assert: the orphan is gone with its group
    for _ in range(100):
        if _gone(pid):
            break
        time.sleep(0.05)
    assert _gone(pid)


def test_a_child_that_exits_before_ready_is_reported_with_its_output(tmp_path):
    child = ChildProcess(
        "failing", _python("print('bad flag'); raise SystemExit(3)"), tmp_path / "l"
    )
    with pytest.raises(ChildExitedError, match=r"failing exited with status 3: bad"):
        child.wait_ready(lambda: False, timeout_s=30)


def test_a_child_not_ready_in_time_is_stopped(tmp_path):
    child = ChildProcess("slow", _python("import time; time.sleep(60)"), tmp_path / "l")
    with pytest.raises(TimeoutError, match="slow was not ready within 0.3 s"):
        child.wait_ready(lambda: False, timeout_s=0.3)
    assert not child.alive()


def test_children_get_child_env_by_default(tmp_path):
    out = tmp_path / "path.txt"
    code = (
        f"import os, pathlib; pathlib.Path({str(out)!r}).write_text(os.environ['PATH'])"
    )
    child = ChildProcess("env", _python(code), tmp_path / "l")
    assert child.wait(30) == 0
    assert out.read_text().split(os.pathsep)[0] == interpreter_bin()
    marked = ChildProcess(
        "env2",
        _python("import os; raise SystemExit(os.environ['AISYN_X'] != '1')"),
        tmp_path / "l2",
        env=child_env(AISYN_X="1"),
    )
    assert marked.wait(30) == 0


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_ends_when_its_parent_is_killed_with_sigkill(tmp_path):
    """A parent killed with SIGKILL runs no cleanup; its child (a spawned
    compute party, a SuperNode) must not run on: the kernel sends it SIGTERM."""
    import signal
    import subprocess

    # Prepare: a parent that starts a sleeping child the project's way
    pid_file = tmp_path / "child.pid"
    parent_code = (
        "import sys, time, pathlib\n"
        "from aisyn.procs import ChildProcess\n"
        "c = ChildProcess('sleeper', [sys.executable, '-c', "
        "'import time; time.sleep(120)'], pathlib.Path(sys.argv[1]) / 'c.log')\n"
        "pathlib.Path(sys.argv[1], 'child.pid').write_text(str(c.pid))\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code, str(tmp_path)])
    try:
        for _ in range(200):
            if pid_file.is_file() and pid_file.read_text():
                break
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert not _gone_or_zombie(child)
        # Execute
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        # Assert: the child is gone within seconds
        for _ in range(200):
            if _gone_or_zombie(child):
                break
            time.sleep(0.05)
        assert _gone_or_zombie(child)
    finally:
        parent.kill()
        if pid_file.is_file() and not _gone_or_zombie(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_missing_program_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-program-aisyn"):
        ChildProcess("x", ["no-such-program-aisyn"], tmp_path / "l")


def _gone_or_zombie(pid: int) -> bool:
    """Ended: no such process, or a zombie its new parent has not reaped."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


# A command whose SIGTERM arrives while a C extension initialises: the
# SystemExit the handler raises surfaces as ImportError (matplotlib's first
# import did this on a torchrun rank that its agent stopped).
_SIGTERM_IN_AN_IMPORT = """
import argparse, os, signal, sys, time
from aisyn import cli

def command(args):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    except SystemExit as e:
        raise ImportError("initialization failed") from e

class Parser:
    def parse_args(self, argv):
        return argparse.Namespace(func=command, verbose=False)

cli.build_parser = Parser
sys.exit(cli.main([]))
"""


@pytest.mark.parametrize("world", ["1", "2"], ids=["one process", "a rank"])
def test_sigterm_ends_a_command_as_terminated_even_inside_an_import(world):
    import signal
    import subprocess

    env = {**os.environ, "WORLD_SIZE": world}
    done = subprocess.run(
        [sys.executable, "-c", _SIGTERM_IN_AN_IMPORT],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_each_command_starts_with_no_signal_recorded():
    """A process that survived a SIGTERM (pytest itself, whose tests run
    commands in-process) must not have its next command end as terminated."""
    import signal

    from aisyn import procs

    previous = signal.getsignal(signal.SIGTERM)
    try:
        procs.end_on_sigterm()
        assert procs.terminated() is None
        with pytest.raises(SystemExit):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert procs.terminated() == signal.SIGTERM
        procs.end_on_sigterm()  # the next command
        assert procs.terminated() is None
    finally:
        signal.signal(signal.SIGTERM, previous)

"""aisyn.procs.ChildProcess: the one way the project starts, awaits and stops
its long-running children (Flower's processes, a spawned compute party)."""

from __future__ import annotations

import os
import sys
import time

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


def test_ready_then_stopped_with_its_children(tmp_path):
    # Prepare: a child that starts a grandchild, then says it is ready
    ready, grandchild = tmp_path / "ready", tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time, pathlib;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"pathlib.Path({str(grandchild)!r}).write_text(str(p.pid));"
        f"pathlib.Path({str(ready)!r}).write_text('ok'); print('up', flush=True);"
        "time.sleep(60)"
    )
    # Execute
    child = ChildProcess("sleeper", _python(code), tmp_path / "log" / "child.log")
    child.wait_ready(ready.is_file, timeout_s=30)
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

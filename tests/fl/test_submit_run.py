"""``runtime.submit_run``: the `flwr run --stream` it starts is one more child
of ``procs.ChildProcess`` — its stream logged (and echoed), its exit status
returned, and past the timeout its whole process group stopped."""

from __future__ import annotations

import os
import time

import pytest

from aisyn.fl import runtime


def fake_flwr(tmp_path, monkeypatch, body: str):
    """A stand-in `flwr` that runs ``body`` (sh) whatever its arguments."""
    script = tmp_path / "flwr"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    monkeypatch.setattr(runtime, "executable", lambda name: str(script))


def test_the_stream_is_logged_echoed_and_its_status_returned(
    tmp_path, monkeypatch, capfd
):
    fake_flwr(tmp_path, monkeypatch, 'echo "round 1"; echo "第二轮 done"; exit 3')
    work = tmp_path / "work"
    (work / "flwr-run.log").parent.mkdir(parents=True)
    (work / "flwr-run.log").write_text("an earlier run\n")
    rc = runtime.submit_run(tmp_path / "app", "127.0.0.1:1", work, echo=True)
    assert rc == 3
    log = (work / "flwr-run.log").read_text()
    assert log == "an earlier run\nround 1\n第二轮 done\n"
    err = capfd.readouterr().err
    assert "round 1\n第二轮 done\n" in err and "an earlier run" not in err


@pytest.mark.heavy
def test_past_its_timeout_the_whole_process_group_is_stopped(tmp_path, monkeypatch):
    pid_file = tmp_path / "child.pid"
    fake_flwr(
        tmp_path, monkeypatch, f"sleep 60 & echo $! > {pid_file}; echo started; wait"
    )
    begin = time.monotonic()
    with pytest.raises(TimeoutError, match="federated run exceeded 1 s"):
        runtime.submit_run(tmp_path / "app", "127.0.0.1:1", tmp_path / "w", timeout=1)
    assert time.monotonic() - begin < 15
    child = int(pid_file.read_text())
    for _ in range(50):  # the orphaned `sleep` is reaped by init shortly
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the run's child process {child} outlived the timeout")

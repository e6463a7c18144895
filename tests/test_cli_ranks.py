"""A torchrun job that stops on a one-line error says it once: the rank that
stopped prints its line, every other rank exits without a word (the failure
of its collectives follows from that rank's exit) and none with a traceback
-- whichever command runs over the ranks."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from aisyn.net import free_port


def torchrun(tmp_path: Path, *args: str, env: dict, timeout: float = 120):
    """``torchrun --nproc-per-node 2 -m aisyn.cli ARGS`` to its end, each
    rank's output in a file of its own (torchrun's ``--redirects``): what the
    ranks printed, apart from the launcher's own report of a failed job."""
    logs = tmp_path / "logs"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "--redirects", "3",
        "--log-dir", str(logs), "-m", "aisyn.cli", *args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        launcher, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    ranks = {}
    for rank in (0, 1):
        (folder,) = logs.glob(f"*/attempt_0/{rank}")
        ranks[rank] = "".join(
            (folder / f).read_text() for f in ("stdout.log", "stderr.log")
        )
    return proc.returncode, ranks, launcher


@pytest.mark.parametrize(
    ("args", "env", "error"),
    [
        # refused on rank 0 alone, while rank 1 waits for its word
        pytest.param(
            [
                "split",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--model",
                "tiny",
                "--insecure",
            ],  # fmt: skip
            {"AISYN_SPLIT_TOKEN": ""},
            "aisyn: error: no shared token: give --token-file FILE or set "
            "AISYN_SPLIT_TOKEN",
            id="split-serve-without-token",
        ),
        # the data party's ranks: refused at rank 0, the others waiting
        pytest.param(
            [
                "split",
                "train",
                "--mode",
                "grpc",
                "--peer",
                "127.0.0.1:9",
                "--insecure",
                "--model",
                "tiny",
                "--data",
                "DATA",
                "--steps",
                "1",
                "--batch-size",
                "4",
                "--micro-batch-size",
                "2",
            ],  # fmt: skip
            {"AISYN_SPLIT_TOKEN": ""},
            "aisyn: error: no shared token",
            marks=pytest.mark.slow,
            id="split-train-without-token",
        ),
        # refused on every rank alike
        pytest.param(
            [
                "train",
                "--model",
                "tiny",
                "--data",
                "DATA",
                "--batch-size",
                "3",
                "--steps",
                "1",
            ],  # fmt: skip
            {},
            "aisyn: error: --batch-size 3",
            marks=pytest.mark.slow,
            id="train-batch",
        ),
    ],
)
@pytest.mark.heavy
def test_a_refused_torchrun_job_prints_one_line_and_no_traceback(
    tmp_path, news_data, args, env, error
):
    args = [str(news_data) if a == "DATA" else a for a in args]
    args += ["--out", str(tmp_path / "out")]
    code, ranks, launcher = torchrun(tmp_path, *args, env=env)
    assert code != 0
    said = "\n".join(ranks.values())
    lines = [ln for ln in said.splitlines() if ln.startswith("aisyn: error:")]
    assert len(lines) == 1, said
    assert lines[0].startswith(error), said
    assert "Traceback" not in said, said
    # the launcher's own report names no rank's traceback either
    assert "[rank" not in launcher, launcher


def test_a_lost_peer_is_one_line_not_a_traceback(monkeypatch, capsys):
    """A rank whose collective broke because another rank went away, with no
    rank having stopped on a one-line error first (no store to say so here),
    says so in one line; any other failure keeps its traceback (a bug)."""
    from aisyn import cli
    from aisyn.train import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    lost = RuntimeError(
        "[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:40354: "
        "Connection reset by peer. This is typically caused by ..."
    )
    assert distributed.peer_lost(lost)
    assert not distributed.peer_lost(RuntimeError("shape mismatch"))
    assert distributed.claim_stop()  # nothing to tell: every rank says its line

    def command(func):
        """A parser whose parsed command is ``func``."""
        args = argparse.Namespace(func=func, verbose=False)
        return lambda: SimpleNamespace(parse_args=lambda argv: args)

    def broken(args):
        raise lost

    monkeypatch.setattr(cli, "build_parser", command(broken))
    assert cli.main([]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("aisyn: error: rank 1: another rank of the job went away")

    def bug(args):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(cli, "build_parser", command(bug))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        cli.main([])

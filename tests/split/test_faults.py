"""Faults: a killed party (kill -9) is detected within seconds, and restarting
with --resume reaches the same final loss as an uninterrupted run; checkpoint
pairs stay step-consistent even when one side got further than the other."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import CUT, losses, train_cfg

from aisyn.split.client.train import split_train
from aisyn.split.session import SplitOptions
from aisyn.split.transport import LinkSettings
from aisyn.train.run import read_metrics

STEPS, EVERY = 40, 5


def cli_env() -> dict[str, str]:
    return {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1"}


def train_args(cfg_json: Path, data: Path, out: Path) -> list[str]:
    c = train_cfg(steps=STEPS, ckpt_every=EVERY)
    return [
        sys.executable,
        "-m",
        "aisyn.cli",
        "split",
        "train",
        "--model",
        str(cfg_json),
        "--data",
        str(data),
        "--out",
        str(out),
        "--cut",
        CUT,
        "--steps",
        str(c.steps),
        "--batch-size",
        str(c.batch_size),
        "--micro-batch-size",
        str(c.micro_batch_size),
        "--lr",
        str(c.lr),
        "--warmup",
        str(c.warmup_steps),
        "--log-every",
        "1",
        "--seed",
        str(c.seed),
        "--ckpt-every",
        str(EVERY),
        "--device",
        "cpu",
        "--quiet",
        "--defence",  # the uninterrupted run it is held to is undefended
        "none",
    ]


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"process ended early ({proc.returncode})"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


@pytest.fixture(scope="module")
def cfg_json(tmp_path_factory, split_config) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "model.json"
    path.write_text(json.dumps(split_config.to_dict()))
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Run the in-process parts with the one thread the CLI runs get
    (OMP_NUM_THREADS=1): float sums over 1 and 2 threads differ in the last
    bits, and 40 steps of training can amplify that past any tolerance."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, news_data, split_config) -> list[float]:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    split_train(
        split_config,
        [news_data],
        out,
        train_cfg(steps=STEPS, ckpt_every=EVERY),
        SplitOptions(cut=CUT, mode="local"),
        progress=False,
    )
    return losses(out)


def resume_local(news_data, split_config, out: Path) -> None:
    split_train(
        split_config,
        [news_data],
        out,
        train_cfg(steps=STEPS, ckpt_every=EVERY),
        SplitOptions(cut=CUT, mode="local"),
        resume=True,
        progress=False,
    )


def assert_same_run(out: Path, uninterrupted: list[float]) -> None:
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))  # each step logged once
    assert losses(out)[-1] == pytest.approx(uninterrupted[-1], rel=1e-6)
    assert losses(out) == pytest.approx(uninterrupted, rel=1e-6)


@pytest.mark.heavy
def test_kill_9_of_in_process_run_then_resume(
    tmp_path, news_data, split_config, cfg_json, uninterrupted
):
    # Prepare: an in-process split run in a child process
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [*train_args(cfg_json, news_data, out), "--mode", "local"],
        env=cli_env(),
        stderr=subprocess.PIPE,
    )
    # Execute: kill -9 right after the step-10 checkpoint pair exists
    wait_for(out / "checkpoints" / "step_00000010" / "state.json", proc)
    kill9(proc)
    assert not (out / "checkpoints" / f"step_{STEPS:08d}").exists()
    resume_local(news_data, split_config, out)
    # Assert
    assert_same_run(out, uninterrupted)


@pytest.mark.heavy
def test_compute_party_ahead_of_data_party(
    tmp_path, news_data, split_config, uninterrupted
):
    """B saved step 40 but A died before writing its half: both resume from the
    newest step they both have (35) and still end where they should."""
    out = tmp_path / "run"
    split_train(
        split_config,
        [news_data],
        out,
        train_cfg(steps=STEPS, ckpt_every=EVERY),
        SplitOptions(cut=CUT, mode="local"),
        progress=False,
    )
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS:08d}")
    (out / "checkpoints" / "latest").write_text(f"step_{STEPS - EVERY:08d}")
    resume_local(news_data, split_config, out)
    assert_same_run(out, uninterrupted)


def serve_args(cfg_json: Path, root: Path, token: Path, address: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "aisyn.cli",
        "split",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--address-file",
        str(address),
        "--model",
        str(cfg_json),
        "--cut",
        CUT,
        "--out",
        str(root),
        "--token-file",
        str(token),
        "--insecure",
        "--device",
        "cpu",
    ]


def start_serving(cfg_json, root, token, tmp_path) -> tuple[subprocess.Popen, str]:
    address = tmp_path / f"address-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        serve_args(cfg_json, root, token, address),
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(address, proc)
    return proc, address.read_text().strip()


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["compute", "data"])
def test_kill_9_over_grpc_then_resume(
    tmp_path, news_data, split_config, cfg_json, token_file, uninterrupted, victim
):
    # Prepare: a compute party and a data party, each its own process
    b_root, out = tmp_path / "b", tmp_path / "a"
    server, address = start_serving(cfg_json, b_root, token_file, tmp_path)
    peer = ["--mode", "grpc", "--peer", address, "--insecure"]
    peer += ["--token-file", str(token_file)]
    a = subprocess.Popen(
        [*train_args(cfg_json, news_data, out), *peer],
        env=cli_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(out / "checkpoints" / "step_00000010" / "state.json", a)
        # Execute
        if victim == "compute":
            kill9(server)
            t0 = time.monotonic()
            _, err = a.communicate(timeout=30)
            detected = time.monotonic() - t0
            # Assert: the data party notices within seconds and says why
            assert a.returncode == 2, err
            assert detected < 10, f"took {detected:.1f} s to notice"
            assert "aisyn: error:" in err and "peer" in err.lower(), err
            server, address = start_serving(cfg_json, b_root, token_file, tmp_path)
        else:
            kill9(a)
        settings = LinkSettings(address, token_file=str(token_file), insecure=True)
        split_train(
            split_config,
            [news_data],
            out,
            train_cfg(steps=STEPS, ckpt_every=EVERY),
            SplitOptions(cut=CUT, mode="grpc", peer=settings),
            resume=True,
            progress=False,
        )
        assert_same_run(out, uninterrupted)
    finally:
        for p in (a, server):
            if p.poll() is None:
                kill9(p)


def test_damaged_compute_checkpoint_is_refused_with_the_reason(
    tmp_path, news_data, split_config
):
    from aisyn.link.errors import HandshakeError

    out = tmp_path / "run"
    cfg = train_cfg(steps=4, ckpt_every=2)
    opts = SplitOptions(cut=CUT, mode="local")
    split_train(split_config, [news_data], out, cfg, opts, progress=False)
    (b_run,) = (out / "compute").iterdir()
    (b_run / "checkpoints" / "step_00000004" / "model.safetensors").unlink()
    more = train_cfg(steps=6, ckpt_every=2)  # (at --steps 4 there is nothing to do)
    with pytest.raises(HandshakeError, match="model.safetensors: missing"):
        split_train(
            split_config, [news_data], out, more, opts, resume=True, progress=False
        )
    # A's half of the run is untouched by the refused attempt
    assert losses(out) and (out / "checkpoints" / "step_00000004").is_dir()


@pytest.mark.heavy
def test_sigterm_of_data_party_stops_the_spawned_compute_party(
    tmp_path, news_data, split_config
):
    # Prepare: a long --spawn-backbone run, started as a user would
    model = tmp_path / "model.json"
    model.write_text(json.dumps(split_config.to_dict()))
    args = [sys.executable, "-m", "aisyn.cli", "split", "train", "--mode", "grpc"]
    args += ["--spawn-backbone", "--insecure", "--model", str(model), "--cut", CUT]
    args += ["--data", str(news_data), "--out", str(tmp_path / "run")]
    args += ["--steps", "100000", "--batch-size", "2", "--quiet"]
    # (undefended: the default defence's calibration adds seconds, not behaviour)
    args += ["--defence", "none"]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    try:
        spawned = None
        for line in proc.stderr:  # wait until the compute party is up
            if m := re.search(r"spawned compute party pid (\d+)", line):
                spawned = int(m.group(1))
                break
        assert spawned is not None, "no compute party was spawned"
        time.sleep(1.0)  # training under way
        # Execute
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Assert: the command ended as terminated, and took its compute party along
    assert rc == 128 + signal.SIGTERM
    deadline = time.monotonic() + 15
    while _pid_alive(spawned) and time.monotonic() < deadline:
        time.sleep(0.1)
    outlived = _pid_alive(spawned)
    if outlived:  # don't leave it behind when the test fails
        os.kill(spawned, signal.SIGKILL)
    assert not outlived, "the spawned compute party outlived its run"


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # zombie = exited
    except FileNotFoundError:
        return False


def test_split_resume_before_any_checkpoint_and_past_the_end(
    tmp_path, news_data, split_config, monkeypatch
):
    """A split run killed before its first checkpoint resumes with only the
    rerun's metrics rows; one resumed at its last step trains nothing and
    reports its own loss; --steps below it is refused before anything opens."""
    from aisyn.train.regime import Regime

    out = tmp_path / "run"
    cfg = train_cfg(steps=4)
    real_step = Regime.train_step
    calls = {"n": 0}

    def crashing_step(self, step):
        calls["n"] += 1
        if calls["n"] == 3:  # killed after logging steps 1 and 2
            raise KeyboardInterrupt("simulated kill")
        return real_step(self, step)

    monkeypatch.setattr(Regime, "train_step", crashing_step)
    local = SplitOptions(cut=CUT, mode="local")
    with pytest.raises(KeyboardInterrupt):
        split_train(split_config, [news_data], out, cfg, local, progress=False)
    monkeypatch.setattr(Regime, "train_step", real_step)

    split_train(split_config, [news_data], out, cfg, local, resume=True, progress=False)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]

    with pytest.raises(ValueError, match="--steps 2 is below the 4 steps"):
        split_train(
            split_config,
            [news_data],
            out,
            train_cfg(steps=2),
            local,
            resume=True,
            progress=False,
        )
    done = split_train(
        split_config, [news_data], out, cfg, local, resume=True, progress=False
    )
    assert done["final_loss"] == losses(out)[-1]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]

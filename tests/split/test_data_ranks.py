"""The data party as a torchrun job (``split.client.data_ranks``): its blocks
FSDP2-sharded over 2 ranks, each micro-batch's rows shared, it trains what one
process trains -- losses, validation, weights -- under a cut defence too, and
a compute party cannot tell; a rank killed mid-run ends the job in one line,
and the last checkpoint resumes on one process to the uninterrupted losses; a
layout the ranks cannot run is refused in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import TOKEN, losses
from group_run import run_group

from aisyn.model.pangu import PanguConfig
from aisyn.net import free_port
from aisyn.split.client.data_ranks import DataRanks
from aisyn.train import checkpoint as ckpt
from aisyn.train.lora import Method

REL = 1e-5
#: six layers; with u:2,2 the data party holds four blocks and the top query
#: layer, the compute party one block
SIX = PanguConfig(
    vocab_size=8000, hidden_size=32, num_layers=6, num_heads=4, ffn_size=64, seq_len=32
)
#: torchrun gives each rank one thread; so does the baseline (float sums over
#: 1 and 2 threads differ in the last bits)
ENV = {"AISYN_SPLIT_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def six_json(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("six") / "model.json"
    path.write_text(json.dumps(SIX.to_dict()))
    return path


def common(six_json: Path, data: Path, *extra: str) -> list[str]:
    return [
        "--model", str(six_json), "--cut", "u:2,2", "--data", str(data),
        "--seed", "1", "--batch-size", "4", "--micro-batch-size", "2",
        "--log-every", "1", "--quiet", *extra,
    ]  # fmt: skip


def one_process(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aisyn.cli", "split", "train", *args],
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun_args(nproc: int, *args: str, command: str = "train") -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
        "-m", "aisyn.cli", "split", command, *args,
    ]  # fmt: skip


def on_ranks(nproc: int, *args: str, timeout: float = 300):
    """``torchrun --nproc-per-node N -m aisyn.cli split train ...`` to its end
    (its whole process group killed if it outlives ``timeout``)."""
    return run_group(
        torchrun_args(nproc, *args), timeout=timeout, env={**os.environ, **ENV}
    )


def assert_matches(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) and got, (got, want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert worst <= REL, f"losses differ by {worst:.3g} relative: {got} vs {want}"


def val_losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return [r["val_loss"] for r in rows if "val_loss" in r]


def a_weights(run: Path) -> dict[str, torch.Tensor]:
    return ckpt.read_tensors(ckpt.latest(run / "checkpoints") / ckpt.MODEL_FILE)


def assert_same_weights(got: dict, want: dict, whose: str) -> None:
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max() for k in got)
    assert worst < 1e-5, f"{whose} weights differ by {worst:.3g}"


@contextmanager
def serving(six_json: Path, cut: str, root: Path, nproc: int = 1) -> Iterator[list]:
    """``aisyn split serve`` of ``cut`` into ``root`` (under torchrun with
    ``nproc`` > 1); yields A's flags to dial it; its process group is killed
    at the end."""
    address = root.with_name(root.name + ".address")
    args = ["--listen", "127.0.0.1:0", "--address-file", str(address)]
    args += ["--model", str(six_json), "--cut", cut, "--insecure", "--out", str(root)]
    cmd = [sys.executable, "-m", "aisyn.cli", "split", "serve", *args]
    if nproc > 1:
        cmd = torchrun_args(nproc, *args, command="serve")
    serve = subprocess.Popen(
        cmd,
        env={**os.environ, **ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not address.exists():
            assert serve.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        yield ["--mode", "grpc", "--peer", address.read_text().strip(), "--insecure"]
    finally:
        os.killpg(serve.pid, signal.SIGKILL)
        serve.wait(30)


#: clipping and noise both ways: each rank clips its rows and adds its rows
#: of the noise drawn for the whole micro-batch
DEFENCE = ["--dp-forward-clip", "5", "--dp-forward-noise", "0.05"]
DEFENCE += ["--dp-backward-clip", "1", "--dp-backward-noise", "0.05"]


@pytest.mark.heavy
def test_two_ranks_train_what_one_process_trains_through_a_kill_9(
    tmp_path, six_json, news_data
):
    """Windowed (--pipeline 1), EOD-reset masks, validation, a cut defence.
    kill -9 of rank 1 once a checkpoint exists ends the job in one line;
    ``--resume`` on two ranks (rank 1 loading the checkpoint rank 0 wrote)
    then gives the losses, validation losses and (gathered from the shards)
    weights of one uninterrupted process; the run records its world size."""
    args = common(six_json, news_data, "--steps", "8", "--pipeline", "1")
    args += ["--eod-reset", "--eval-every", "2", "--ckpt-every", "2", *DEFENCE]
    out = tmp_path / "two"
    kill_rank_after_a_checkpoint(args, out)
    two = on_ranks(2, "--mode", "local", *args, "--out", str(out), "--resume")
    one = one_process("--mode", "local", *args, "--out", str(tmp_path / "one"))
    assert two.returncode == 0 and one.returncode == 0, two.stderr[-3000:] + one.stderr
    assert_matches(losses(out), losses(tmp_path / "one"))
    assert_matches(val_losses(out), val_losses(tmp_path / "one"))
    got, want = a_weights(out), a_weights(tmp_path / "one")
    assert_same_weights(got, want, "A's")
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2


@pytest.mark.slow
def test_a_compute_party_cannot_tell_even_under_a_cut_defence(
    tmp_path, six_json, news_data
):
    """Two ranks of A over gRPC to a one-process ``aisyn split serve``, under
    the cut defence: the losses of one process with the same defence, and
    B's checkpoint the same."""
    args = common(six_json, news_data, "--steps", "3", *DEFENCE)
    # one compute party serves both runs, one after the other
    with serving(six_json, "u:2,2", tmp_path / "b") as peer:
        two = on_ranks(2, *args, *peer, "--out", str(tmp_path / "two"))
        assert two.returncode == 0, two.stderr[-3000:]
        one = one_process(*args, *peer, "--out", str(tmp_path / "one"))
        assert one.returncode == 0, one.stderr[-3000:]
    assert_matches(losses(tmp_path / "two"), losses(tmp_path / "one"))
    run_id = json.loads((tmp_path / "two" / "config.json").read_text())["run_id"]
    b_two = tmp_path / "b" / run_id
    run_id = json.loads((tmp_path / "one" / "config.json").read_text())["run_id"]
    b_one = tmp_path / "b" / run_id
    got, want = a_weights(b_two), a_weights(b_one)
    assert_same_weights(got, want, "B's")


def _workers(agent: int) -> dict[int, int]:
    """rank -> PID of the torchrun agent ``agent``'s workers."""
    out = {}
    for pid in Path("/proc").iterdir():
        try:
            stat = (pid / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != agent:
                continue
            env = (pid / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        for var in env:
            if var.startswith(b"RANK="):
                out[int(var[5:])] = int(pid.name)
    return out


def kill_rank_after_a_checkpoint(args: list[str], out: Path, rank: int = 1) -> None:
    """``torchrun`` 2 ranks of ``split train --mode local *args``; kill -9 of
    ``rank`` once a checkpoint exists. The job must end within 30 s, the run
    not finished, with one line naming the failure: rank 0's when rank 1
    was killed; at most rank 1's when rank 0 was (torchrun may stop it
    first)."""
    proc = subprocess.Popen(
        torchrun_args(2, "--mode", "local", *args, "--out", str(out)),
        env={**os.environ, **ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ckpt.complete_steps(out / "checkpoints"):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.02)
        os.kill(_workers(proc.pid)[rank], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("aisyn: error:")]
    if rank == 1:
        assert len(lines) == 1, err
        assert "data party's ranks fell out of step" in lines[0], err
    else:
        assert len(lines) <= 1 and all("lost rank 0" in ln for ln in lines), err
    assert took < 30, f"the job took {took:.0f} s to end"
    steps = int(args[args.index("--steps") + 1])
    assert ckpt.complete_steps(out / "checkpoints")[-1] < steps, "ended before kill"


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1], ids=["rank 0", "rank 1"])
def test_a_two_rank_checkpoint_resumes_on_one_process(
    tmp_path, six_json, news_data, rank
):
    """kill -9 of either rank mid-run; ``--resume`` on one process reaches
    the losses of an uninterrupted run."""
    args = common(six_json, news_data, "--steps", "10", "--ckpt-every", "2")
    out = tmp_path / "two"
    kill_rank_after_a_checkpoint(args, out, rank)
    resumed = one_process("--mode", "local", *args, "--out", str(out), "--resume")
    whole = one_process("--mode", "local", *args, "--out", str(tmp_path / "one"))
    assert resumed.returncode == 0 and whole.returncode == 0, resumed.stderr
    assert_matches(losses(out), losses(tmp_path / "one"))


def test_layouts_the_ranks_cannot_run_are_refused_in_one_line():
    """Micro-batches of fewer rows than ranks, and LoRA (not built for sharded
    blocks); refused at rank 0 before the run folder is written (the next
    test shows such a refusal end to end under torchrun)."""
    ranks = DataRanks(rank=0, world=2, ctl=None)
    assert ranks.problem_with(2, Method()) is None
    why = ranks.problem_with(1, Method())
    assert "micro-batches of 1 row(s) would leave ranks idle" in why
    assert "--micro-batch-size of at least 2" in why
    assert "--method lora" in ranks.problem_with(2, Method("lora"))


@pytest.mark.slow
def test_both_parties_as_torchrun_jobs(tmp_path, six_json, news_data):
    """A on 2 ranks (sharded) and B on 2 ranks (two pipeline stages, u:1,1
    leaving it three blocks): the losses of both parties in one process, and
    ``split merge`` of the two jobs' checkpoints its model."""
    args = common(six_json, news_data, "--steps", "4", "--pipeline", "2")
    args[args.index("u:2,2")] = "u:1,1"
    with serving(six_json, "u:1,1", tmp_path / "b", nproc=2) as peer:
        two = on_ranks(2, *args, *peer, "--out", str(tmp_path / "two"))
    one = one_process("--mode", "local", *args, "--out", str(tmp_path / "one"))
    assert two.returncode == 0 and one.returncode == 0, two.stderr[-3000:]
    assert_matches(losses(tmp_path / "two"), losses(tmp_path / "one"))
    # both halves, each from its ranks' checkpoints, merge into one model: the
    # one both parties in one process made
    from aisyn.split.client.merge import merge

    got = merge(tmp_path / "two", tmp_path / "b", tmp_path / "m-two")
    want = merge(tmp_path / "one", tmp_path / "one" / "compute", tmp_path / "m-one")
    got = ckpt.read_tensors(got / ckpt.MODEL_FILE)
    want = ckpt.read_tensors(want / ckpt.MODEL_FILE)
    assert_same_weights(got, want, "merged")


@pytest.mark.heavy
def test_ranks_whose_share_does_not_fit_are_refused_with_the_numbers(
    tmp_path, news_data
):
    """200B's A on 2 ranks: the planner's per-rank figure (a sharded half of
    its blocks, its ends whole) exceeds this machine, refused before any
    weight is allocated (no compute party is dialled)."""
    args = ["--model", "200B", "--data", str(news_data), "--steps", "1"]
    args += ["--batch-size", "2", "--mode", "grpc", "--peer", "127.0.0.1:9"]
    args += ["--insecure", "--seed", "1", "--out", str(tmp_path / "a")]
    run = on_ranks(2, *args, timeout=120)
    assert run.returncode != 0
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("aisyn: error:")]
    assert len(lines) == 1, run.stderr[-3000:]
    assert "split training (party A on 2 rank(s)) with micro-batches of 2" in lines[0]
    assert "GiB" in lines[0] and "is available" in lines[0]


@pytest.mark.slow
def test_split_fine_tuning_on_two_ranks(tmp_path, news_data, tokenizer):
    """``--sft --init-from BASE`` (every rank loads A's share of the base; the
    loss over the answer tokens splits by rows): the losses of one process."""
    from conftest import train_cfg

    from aisyn.data.corpora import load_corpus
    from aisyn.data.sft import prepare_sft
    from aisyn.train.pretrain import train

    ft = PanguConfig(**{**SIX.to_dict(), "seq_len": 64})
    (tmp_path / "ft.json").write_text(json.dumps(ft.to_dict()))
    base = tmp_path / "base"
    train(ft, [news_data], base, train_cfg(steps=2, seed=5), progress=False)
    docs = [d.text.replace("\n", " ") for d in load_corpus("news").documents[:400]]
    corpus = tmp_path / "news.txt"
    corpus.write_text(
        "".join(d[: 10 + (i * 13) % 50] + "\n" for i, d in enumerate(docs)),
        encoding="utf-8",
    )
    prepare_sft(load_corpus(corpus), tokenizer, 64, tmp_path / "sft", per_document=2)
    args = ["--model", str(tmp_path / "ft.json"), "--cut", "u:2,2"]
    args += ["--sft", str(tmp_path / "sft"), "--init-from", str(base)]
    args += ["--seed", "1", "--steps", "4", "--batch-size", "4"]
    args += ["--micro-batch-size", "2", "--log-every", "1", "--quiet"]
    two = on_ranks(2, "--mode", "local", *args, "--out", str(tmp_path / "two"))
    one = one_process("--mode", "local", *args, "--out", str(tmp_path / "one"))
    assert two.returncode == 0 and one.returncode == 0, two.stderr[-3000:]
    assert_matches(losses(tmp_path / "two"), losses(tmp_path / "one"))

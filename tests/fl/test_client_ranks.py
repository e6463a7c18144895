"""A federated client's local steps on 2 data-parallel ranks (aisyn.fl.ranks)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from aisyn.fl.records import tensors_to_record
from aisyn.fl.settings import FLSettings
from aisyn.train import checkpoint as ckpt
from aisyn.train.lora import apply_method, trainable_tensors


def _round(base_run, **kw):
    from aisyn.fl.round_message import round_config
    from aisyn.train.models import describe_base, load_base

    settings = FLSettings.from_dict(
        dict(
            rounds=1,
            local_steps=3,
            batch_size=4,
            lr=1e-3,
            warmup=1,
            eval_items=8,
            min_clients=1,
            round_timeout=120,
        )
        | kw
    )
    info = describe_base(base_run)
    model, _ = load_base(info)
    glob = trainable_tensors(apply_method(model, settings.method_spec()))
    config = round_config(settings, info)
    config["server-round"] = 1
    return config, glob


@pytest.mark.heavy
def test_two_rank_client_trains_what_one_rank_does(base_run, sft_dirs, tmp_path):
    from aisyn.fl.client import ClientNode, client_train

    config, glob = _round(base_run, lr=1e-4)
    out = {}
    for ranks in (1, 2):
        node = ClientNode(
            "news", sft_dirs["news"], base_run, tmp_path / f"r{ranks}", ranks
        )
        records, metrics = client_train(node, config, tensors_to_record(glob))
        arrays = records["arrays"]
        out[ranks] = {k: torch.from_numpy(a.numpy()) for k, a in arrays.items()}
        out[f"loss{ranks}"] = metrics["train-loss"]
    diff = max(float((out[1][k] - out[2][k]).abs().max()) for k in glob)
    moved = max(float((out[1][k] - glob[k]).abs().max()) for k in glob)
    assert moved > 1e-5 and diff <= 1e-6, (diff, moved)
    assert abs(out["loss1"] - out["loss2"]) <= 1e-5
    # the ranks' private folder is gone; rank 0 logged the steps
    assert not list((tmp_path / "r2").glob("ranks-*"))
    assert (tmp_path / "r2" / "metrics.jsonl").is_file()


@pytest.mark.heavy
def test_a_two_rank_client_keeps_its_optimizer_as_one_rank_does(
    base_run, sft_dirs, tmp_path
):
    # Prepare: two rounds with --local-optimizer kept (round 2 loads round 1's
    # moments on every rank; rank 0 saves them)
    from aisyn.fl.client import OPTIMIZERS, ClientNode, client_train

    config, glob = _round(base_run, lr=1e-4, rounds=2, local_optimizer="kept")
    out = {}
    # Execute
    for ranks in (1, 2):
        node = ClientNode(
            "news", sft_dirs["news"], base_run, tmp_path / f"r{ranks}", ranks
        )
        arrays = tensors_to_record(glob)
        for server_round in (1, 2):
            config["server-round"] = server_round
            records, _ = client_train(node, config, arrays)
            arrays = records["arrays"]
        out[ranks] = {k: torch.from_numpy(a.numpy()) for k, a in arrays.items()}
    # Assert: the same model; the moments of both rounds in the client's folder
    diff = max(float((out[1][k] - out[2][k]).abs().max()) for k in glob)
    assert diff <= 1e-6, diff
    assert OPTIMIZERS.latest_before(tmp_path / "r2", 3) == OPTIMIZERS.path(
        tmp_path / "r2", 2
    )
    one = ckpt.read_tensors(OPTIMIZERS.path(tmp_path / "r1", 2))
    two = ckpt.read_tensors(OPTIMIZERS.path(tmp_path / "r2", 2))
    assert one.keys() == two.keys()
    assert all(torch.allclose(one[k], two[k], atol=1e-6) for k in one)


def _rank_pids(out: Path) -> dict[int, int]:
    """{rank: pid} of the training ranks working under ``out``."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        args = [a.decode(errors="replace") for a in cmd]
        if "aisyn.fl.ranks" not in args or "torch.distributed.run" in args:
            continue
        if not any(a.startswith(str(out)) for a in args) or "-c" in args:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(proc.name)
    return found


@pytest.mark.heavy
def test_a_rank_killed_mid_step_fails_the_round_in_one_line(
    base_run, sft_dirs, tmp_path
):
    from aisyn.fl.client import ClientNode, client_train
    from aisyn.fl.ranks import RanksFailed

    config, glob = _round(base_run, local_steps=400, round_timeout=60)
    out = tmp_path / "client"
    node = ClientNode("news", sft_dirs["news"], base_run, out, 2)
    caught: list[BaseException] = []

    def run():
        try:
            client_train(node, config, tensors_to_record(glob))
        except BaseException as e:  # the thread's outcome, for the test
            caught.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    pids: dict[int, int] = {}
    while time.monotonic() < deadline and not (
        len(pids) == 2 and (out / "metrics.jsonl").is_file()  # rank 0 logs step 10
    ):
        pids = _rank_pids(out)
        time.sleep(0.1)
    assert len(pids) == 2, "the ranks never started"
    t_kill = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the client hung after its rank died"
    assert time.monotonic() - t_kill < 30
    assert len(caught) == 1 and isinstance(caught[0], RanksFailed), caught
    message = str(caught[0])
    assert "\n" not in message and "a training rank failed" in message, message
    assert not _rank_pids(out)  # rank 0 ended too
    assert not list(out.glob("ranks-*"))

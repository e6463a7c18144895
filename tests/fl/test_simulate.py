"""Federated runs through Flower's deployment runtime on loopback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aisyn.data.sft import SFTData
from aisyn.fl.launch import simulate
from aisyn.fl.settings import FLSettings
from aisyn.train.run import read_metrics


def _check_run(result: dict, run, clients: list[str]) -> None:
    hist = result["history"]
    assert [h["round"] for h in hist] == [1, 2]
    # the global model's validation loss drops: base (before round 1) -> final
    assert result["final_global_valid_loss"] < hist[0]["global_valid_loss"] - 0.3
    # per-node run folders: metrics with bytes, loss curves, checkpoints
    server = run / "server"
    assert (server / "loss.png").is_file() and (
        server / "checkpoints" / "latest"
    ).is_file()
    for name in clients:
        node = run / "clients" / name
        rounds = [r for r in read_metrics(node / "metrics.jsonl") if "round_loss" in r]
        assert [r["round"] for r in rounds] == [1, 2]
        assert all(r["bytes_received"] == r["bytes_sent"] > 0 for r in rounds)
        assert (node / "loss.png").is_file()
    config = json.loads((server / "config.json").read_text())
    assert config["kind"] == "finetune"  # so `aisyn eval` scores it in prompt format


def small_run(**overrides) -> FLSettings:
    """Two short rounds of two clients; ``overrides`` change what a test needs."""
    return FLSettings.from_dict(
        dict(rounds=2, batch_size=8, lr=3e-3, warmup=1, eval_items=16, min_clients=2)
        | overrides
    )


@pytest.mark.slow  # the default suite runs a federation end to end in the LoRA test
def test_two_clients_two_rounds_loopback_run_completes_and_loss_drops(
    base_run, sft_dirs, tmp_path
):
    # Prepare
    settings = small_run(local_steps=4, eval_items=32, round_timeout=300)
    # Execute
    result = simulate(base_run, sft_dirs, tmp_path / "run", settings)
    # Assert
    for h in result["history"]:
        assert h["accepted"] == 2 and h["rejected"] == []
        assert (
            h["bytes_sent"]
            == h["bytes_received"]
            == 2 * result["payload_bytes_per_client"]
        )
    _check_run(result, tmp_path / "run", ["news", "reviews"])
    # the server knew both clients' data: num-examples counts at most the larger
    sizes = [len(SFTData.open(d, "train")) for d in sft_dirs.values()]
    assert result["settings"]["max_examples"] == max(sizes)


@pytest.mark.slow
def test_failing_client_is_rejected_and_the_run_goes_on(base_run, sft_dirs, tmp_path):
    """A third client whose data vanished fails every round; its error replies are
    rejected and logged, the two others are aggregated."""
    # Prepare
    settings = small_run(local_steps=3, eval_items=32, min_clients=3, round_timeout=300)
    clients = {**sft_dirs, "broken": tmp_path / "no-such-data"}
    # Execute
    result = simulate(base_run, clients, tmp_path / "run", settings, validate=False)
    # Assert
    for h in result["history"]:
        assert h["accepted"] == 2
        [rejected] = h["rejected"]
        assert (
            "client failed" in rejected["reason"]
            and "no-such-data" in rejected["reason"]
        )
        assert h["bytes_received"] == 2 * result["payload_bytes_per_client"]
    _check_run(result, tmp_path / "run", ["news", "reviews"])


@pytest.mark.heavy
def test_cli_reports_a_client_without_data_in_one_line(base_run, tmp_path):
    # Execute
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aisyn.cli",
            "fl",
            "simulate",
            "--base",
            str(base_run),
            "--client",
            f"acme={tmp_path / 'missing'}",
            "--client",
            "b=x",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Assert: exit 2, one line naming the client and the problem, nothing started
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("aisyn: error: client acme:") and "not found" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_run_over_tls(base_run, sft_dirs, tmp_path):
    from aisyn.fl.runtime import ServerTls
    from aisyn.link import make_dev_certs

    # Prepare: a throwaway CA and a server certificate for 127.0.0.1
    certs = make_dev_certs(tmp_path / "certs")
    tls = ServerTls(certs.server_cert, certs.server_key, certs.ca_cert)
    settings = small_run(local_steps=2)
    # Execute
    result = simulate(base_run, sft_dirs, tmp_path / "run", settings, tls=tls)
    # Assert
    assert [h["accepted"] for h in result["history"]] == [2, 2]
    log = (tmp_path / "run" / "runtime" / "superlink" / "superlink.log").read_text()
    assert "https" in log.lower() or "ssl" in log.lower() or "tls" in log.lower()
    # each client joined with its own registered key (SuperNode authentication)
    assert log.count("[ControlServicer.RegisterNode] Created") == 2
    assert log.count("[Fleet.ActivateNode] Activated") == 2


def _pids_with(text: str) -> list[int]:
    """Our own processes whose command line mentions ``text`` (a unique tmp path)."""
    import os
    from pathlib import Path

    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd and int(proc.name) != os.getpid():
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
def test_client_that_drops_out_mid_round_does_not_stop_the_server(
    base_run, sft_dirs, tmp_path
):
    import os
    import signal
    import threading
    import time

    # Prepare: one client is killed (its whole process group) while training round 1
    settings = small_run(local_steps=60, lr=1e-3, min_clients=1, round_timeout=150)
    result: dict = {}

    def run() -> None:
        result.update(simulate(base_run, sft_dirs, tmp_path / "run", settings))

    worker = threading.Thread(target=run)
    worker.start()
    metrics = tmp_path / "run" / "clients" / "reviews" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not metrics.is_file() and time.monotonic() < deadline:
        time.sleep(0.5)
    node_config = str(tmp_path / "run" / "runtime" / "client-reviews")
    # Execute
    for pid in _pids_with(node_config):  # the reviews SuperNode, started by this test
        try:
            group = os.getpgid(pid)
            if group != os.getpgrp():  # its own group, never the one running the test
                os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    worker.join(900)
    # Assert: the run finished; round 1 aggregated the update that arrived
    assert not worker.is_alive()
    hist = result["history"]
    assert [h["round"] for h in hist] == [1, 2]
    assert hist[0]["accepted"] == 1
    assert hist[1]["accepted"] == 1 and hist[1]["clients"] == 1
    assert result["final_global_valid_loss"] is not None


# slow: the default suite runs Flower end to end in test_client_dp.py, and LoRA
# on each family's own layers and its payload in test_local_training.py
@pytest.mark.slow
def test_lora_federated_fine_tuning_of_a_llama_base(
    tokenizer, sft_dirs, tmp_path, base_run_factory
):
    """The same run with a Llama-family base (grouped-query attention, rotary
    positions, RMSNorm): LoRA adapters on its own layers cross, the loss drops
    and the server's merged checkpoint is a plain Llama."""
    from aisyn.model.hf import HFConfig
    from aisyn.train.checkpoint import model_file, read_tensors

    cfg = HFConfig(
        family="llama",
        vocab_size=8000,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_size=64,
        seq_len=48,
    )
    base = base_run_factory(tmp_path / "base", cfg, tokenizer)
    settings = small_run(
        local_steps=4,
        eval_items=32,
        lr=1e-2,
        method="lora",
        lora_rank=4,
        round_timeout=300,
    )
    result = simulate(base, sft_dirs, tmp_path / "run", settings)
    hist = result["history"]
    assert [h["accepted"] for h in hist] == [2, 2]
    assert result["final_global_valid_loss"] < hist[0]["global_valid_loss"]
    merged = read_tensors(model_file(tmp_path / "run" / "server"))
    assert "model.layers.1.self_attn.o_proj.weight" in merged
    assert not any("lora_" in n for n in merged)


def test_the_global_loss_plot_counts_whole_rounds():
    from aisyn.fl.federation import global_loss_figure

    history = [
        {"round": 1, "global_valid_loss": 6.0},
        {"round": 2, "global_valid_loss": 5.5},
    ]
    fig = global_loss_figure(history, 5.2)
    ax = fig.axes[0]
    (line,) = ax.get_lines()
    assert line.get_label() == "global model, clients' valid items"
    assert list(line.get_xdata()) == [0, 1, 2]
    assert list(line.get_ydata()) == [6.0, 5.5, 5.2]
    ticks = [t for t in ax.get_xticks() if 0 <= t <= 2]
    assert ticks and all(float(t).is_integer() for t in ticks)

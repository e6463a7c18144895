"""A federated server that stops after round k resumes at round k + 1 and ends
where an uninterrupted run ends; a resume it cannot honour is refused in one
line, before anything is written.

The federations here run in this process (``aisyn.fl.in_process``: the real
ServerApp code over the real ClientApp, one client after another), so they are
deterministic and a resumed run can be compared bit for bit.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.supercore.task_identity import TaskIdentity
from sigkill import kill_once

from aisyn.fl.client import ClientContext, ClientNode
from aisyn.fl.federation import FEDERATION_FILE, FederationStateError
from aisyn.fl.in_process import RUN_ID, InProcessGrid
from aisyn.fl.server import ServerNode, run_server
from aisyn.fl.settings import FLSettings
from aisyn.train import checkpoint as ckpt
from aisyn.train.run import read_metrics

HERE = Path(__file__).parent


@pytest.fixture(autouse=True, scope="module")
def _in_process_identity():
    """The messages the strategy builds carry the running task's IDs."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def settings(**overrides) -> FLSettings:
    return FLSettings.from_dict(
        dict(
            rounds=3,
            local_steps=2,
            batch_size=8,
            lr=3e-3,
            warmup=1,
            eval_items=8,
            min_clients=2,
            strategy="fedadam",
        )
        | overrides
    )


def nodes(base: Path, sft_dirs: dict, out: Path) -> dict[int, dict]:
    return {
        i: {
            "name": name,
            "data": str(data),
            "base": str(base),
            "out": str(out / "clients" / name),
        }
        for i, (name, data) in enumerate(sorted(sft_dirs.items()), start=1)
    }


class Killed(Exception):
    """The server 'dies' here (a test stand-in for SIGKILL)."""


class DyingGrid(InProcessGrid):
    """An in-process grid whose server dies before its ``calls``-th exchange
    (a round is two: train, evaluate)."""

    def __init__(self, nodes: dict, calls: int) -> None:
        super().__init__(nodes)
        self.calls = calls

    def send_and_receive(self, messages, *, timeout=None):
        if self.calls == 0:
            raise Killed
        self.calls -= 1
        return super().send_and_receive(messages, timeout=timeout)


def server_weights(out: Path) -> dict[str, torch.Tensor]:
    return ckpt.read_tensors(ckpt.model_file(out / "server"))


def federation_state(out: Path) -> dict[str, torch.Tensor]:
    folder = ckpt.latest(out / "server" / "checkpoints")
    return ckpt.read_tensors(folder / FEDERATION_FILE)


def assert_same_run(resumed: dict, whole: dict, a: Path, b: Path) -> None:
    wa, wb = server_weights(a), server_weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # bit for bit
    sa, sb = federation_state(a), federation_state(b)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa if not k.startswith("rng."))
    assert resumed["final_global_valid_loss"] == whole["final_global_valid_loss"]
    keys = ("round", "accepted", "global_valid_loss", "train_loss", "step")
    assert [{k: h.get(k) for k in keys} for h in resumed["history"]] == [
        {k: h.get(k) for k in keys} for h in whole["history"]
    ]
    lines = [m["round"] for m in read_metrics(a / "server" / "metrics.jsonl")]
    assert lines == [1, 2, 3, 3]  # one line a round and the final one, no repeats


#: the runs a resume must reproduce: server optimisers with state of their
#: own, and server-side DP, whose noise comes from the server's random state
VARIANTS = {
    "fedadam": {},
    "fedavgm": {"strategy": "fedavgm"},
    "server-dp": {"strategy": "fedavg", "dp": "server", "dp_clipping_norm": 0.5},
    # the server's c in its checkpoint, each client's c_i in its own folder
    "scaffold": {"strategy": "scaffold"},
}


def same_draws() -> None:
    """The server's random state as the uninterrupted run had it: its DP
    noise and client sampling are unseeded (secret) by design, so the runs
    compared must start from one state; the resumed run restores its own."""
    np.random.seed(0)
    random.seed(0)


@pytest.fixture(scope="module")
def whole(tmp_path_factory, base_run, sft_dirs) -> dict:
    """Uninterrupted runs, by variant."""
    out = {}
    for variant in VARIANTS:
        run = tmp_path_factory.mktemp(f"whole-{variant}")
        same_draws()
        result = run_server(
            settings(**VARIANTS[variant]),
            ServerNode(base_run, run / "server"),
            InProcessGrid(nodes(base_run, sft_dirs, run)),
        )
        out[variant] = (run, result)
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_server_that_dies_after_round_2_resumes_and_ends_bit_exact(
    variant, whole, base_run, sft_dirs, tmp_path
):
    # Prepare: a run that dies before round 3 (FedAdam's moments, FedAvgM's
    # momentum and the DP noise's random state are the server's own: a resume
    # that lost them would differ)
    s = settings(**VARIANTS[variant])
    run = tmp_path / "run"
    same_draws()
    with pytest.raises(Killed):
        run_server(
            s,
            ServerNode(base_run, run / "server"),
            DyingGrid(nodes(base_run, sft_dirs, run), 4),
        )
    assert ckpt.read_state(ckpt.latest(run / "server" / "checkpoints"))["round"] == 2
    # Execute: in a process whose random state is not the dead one's
    np.random.seed(12345)
    random.seed(12345)
    resumed = run_server(
        s,
        ServerNode(base_run, run / "server", resume=True),
        InProcessGrid(nodes(base_run, sft_dirs, run)),
    )
    # Assert
    assert resumed["resumed_at_round"] == 3
    whole_run, whole_result = whole[variant]
    assert_same_run(resumed, whole_result, run, whole_run)
    if variant == "scaffold":  # c moved, and every client kept its c_i
        state = federation_state(run)
        control = [v for k, v in state.items() if k.startswith("strategy.control/")]
        assert control and any(v.any() for v in control)
        for name in sft_dirs:
            folder = run / "clients" / name / "scaffold"
            assert (folder / "control-00003.safetensors").is_file()


def test_resuming_a_finished_run_changes_nothing(whole, base_run, sft_dirs):
    run, result = whole["fedadam"]
    before = server_weights(run)
    again = run_server(
        settings(),
        ServerNode(base_run, run / "server", resume=True),
        InProcessGrid(nodes(base_run, sft_dirs, run)),
    )
    assert again["final_global_valid_loss"] == result["final_global_valid_loss"]
    after = server_weights(run)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [m["round"] for m in read_metrics(run / "server" / "metrics.jsonl")] == [
        1,
        2,
        3,
        3,
    ]


@pytest.mark.heavy
def test_a_server_killed_with_sigkill_resumes_and_ends_bit_exact(
    whole, base_run, sft_dirs, tmp_path
):
    # Prepare: the server in its own process, killed once round 1 is saved
    run = tmp_path / "run"
    args = [sys.executable, str(HERE / "federation_proc.py"), str(base_run), str(run)]
    args += [f"{k}={v}" for k, v in sorted(sft_dirs.items())]
    kill_once(args, run / "server" / "checkpoints" / "latest")
    saved = ckpt.read_state(ckpt.latest(run / "server" / "checkpoints"))["round"]
    # Execute
    resumed = run_server(
        settings(),
        ServerNode(base_run, run / "server", resume=True),
        InProcessGrid(nodes(base_run, sft_dirs, run)),
    )
    # Assert
    assert resumed["resumed_at_round"] == saved + 1
    whole_run, whole_result = whole["fedadam"]
    assert_same_run(resumed, whole_result, run, whole_run)


# -- refusals ------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def saved_run(whole, tmp_path) -> Path:
    """A copy of the finished FedAdam run, for a test to damage."""
    import shutil

    run, _ = whole["fedadam"]
    copy = tmp_path / "copy"
    shutil.copytree(run / "server", copy / "server")
    return copy


def resume(base: Path, run: Path, s: FLSettings | None = None) -> dict:
    return run_server(
        s or settings(),
        ServerNode(base, run / "server", resume=True),
        InProcessGrid({}),  # never reached: every refusal comes first
    )


def test_resume_without_a_run_is_refused(base_run, tmp_path):
    with pytest.raises(ValueError, match="holds no federated run"):
        resume(base_run, tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lr": 1e-3}, r"other settings \(lr 0.003 -> 0.001\)"),
        ({"strategy": "fedavg"}, r"other settings \(strategy 'fedadam' -> 'fedavg'\)"),
    ],
)
def test_resume_with_other_settings_is_refused_and_nothing_is_written(
    change, message, saved_run, base_run
):
    before = snapshot(saved_run)
    with pytest.raises(ValueError, match=message):
        resume(base_run, saved_run, settings(**change))
    assert snapshot(saved_run) == before


def test_resume_from_another_base_is_refused(
    saved_run, base_run_factory, fl_config, tokenizer, tmp_path
):
    other = base_run_factory(tmp_path / "other", fl_config, tokenizer, seed=1)
    before = snapshot(saved_run)
    with pytest.raises(ValueError, match="another base model"):
        resume(other, saved_run)
    assert snapshot(saved_run) == before


def _latest(run: Path) -> Path:
    return ckpt.latest(run / "server" / "checkpoints")


def _truncate(run: Path) -> None:
    f = _latest(run) / FEDERATION_FILE
    f.write_bytes(f.read_bytes()[:100])


def _delete(run: Path) -> None:
    (_latest(run) / FEDERATION_FILE).unlink()


def _other_strategy(run: Path) -> None:
    f = _latest(run) / ckpt.STATE_FILE
    state = json.loads(f.read_text())
    state["federation"]["settings"]["strategy"] = "fedavgm"
    f.write_text(json.dumps(state))


def _other_model(run: Path) -> None:
    from safetensors.torch import save_file

    f = _latest(run) / FEDERATION_FILE
    tensors = ckpt.read_tensors(f)
    name = next(k for k in tensors if k.startswith("global/"))
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(f))


def _not_finite(run: Path) -> None:
    from safetensors.torch import save_file

    f = _latest(run) / FEDERATION_FILE
    tensors = ckpt.read_tensors(f)
    name = next(k for k in tensors if k.startswith("strategy.v_t/"))
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    save_file(tensors, str(f))


def _no_state(run: Path) -> None:
    f = _latest(run) / ckpt.STATE_FILE
    state = json.loads(f.read_text())
    del state["federation"]
    f.write_text(json.dumps(state))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_truncate, "corrupt safetensors file"),
        (_delete, "missing"),
        (_other_strategy, "saved by a federation with"),
        (_other_model, r"saved for another model \(.* is \(3, 3\), this model.s"),
        (_not_finite, "holds non-finite values"),
        (_no_state, "holds no federation state"),
    ],
)
def test_a_damaged_or_foreign_checkpoint_is_refused_in_one_line(
    damage, message, saved_run, base_run
):
    damage(saved_run)
    before = snapshot(saved_run)
    with pytest.raises(FederationStateError, match=message) as e:
        resume(base_run, saved_run)
    assert "\n" not in str(e.value)
    assert snapshot(saved_run) == before


def test_a_client_whose_folder_holds_another_federation_is_refused(
    whole, base_run, sft_dirs
):
    run, _ = whole["fedadam"]
    name, data = sorted(sft_dirs.items())[0]
    node = ClientNode(name, data, base_run, run / "clients" / name)
    with pytest.raises(ValueError, match=rf"client {name}: .* other settings \(lr\)"):
        ClientContext(node, settings(lr=1e-3), "")


@pytest.mark.heavy
def test_cli_resume_without_a_run_says_so_in_one_line(base_run, sft_dirs, tmp_path):
    clients = [f"--client={k}={v}" for k, v in sorted(sft_dirs.items())]
    proc = subprocess.run(
        [sys.executable, "-m", "aisyn.cli", "fl", "simulate", "--base", str(base_run)]
        + clients
        + ["--out", str(tmp_path / "run"), "--resume"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert (
        line.startswith("aisyn: error: --resume:") and "holds no federated run" in line
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # Flower's runtime twice (SuperLink, SuperNodes, ServerApp)
def test_fl_simulate_killed_with_sigkill_resumes_with_resume(
    base_run, sft_dirs, tmp_path
):
    # Prepare: `aisyn fl simulate` of three rounds, killed once a round is saved
    run = tmp_path / "run"
    clients = [f"--client={k}={v}" for k, v in sorted(sft_dirs.items())]
    flags = ["--rounds", "3", "--local-steps", "2", "--batch-size", "8"]
    flags += ["--eval-items", "8", "--strategy", "fedadam", "--round-timeout", "120"]
    cmd = [sys.executable, "-m", "aisyn.cli", "fl", "simulate", "--base", str(base_run)]
    cmd += clients + ["--out", str(run)] + flags
    kill_once(cmd, run / "server" / "checkpoints" / "latest")
    saved = ckpt.read_state(_latest(run))["round"]
    assert saved < 3
    # Execute
    done = subprocess.run(
        cmd + ["--resume"], capture_output=True, text=True, timeout=600
    )
    # Assert: the rounds after the saved one ran, once each
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((run / "server" / "result.json").read_text())
    assert result["resumed_at_round"] == saved + 1
    assert [h["round"] for h in result["history"]] == [1, 2, 3]
    assert result["final_global_valid_loss"] is not None
    rounds = [m["round"] for m in read_metrics(run / "server" / "metrics.jsonl")]
    assert rounds == [1, 2, 3, 3]

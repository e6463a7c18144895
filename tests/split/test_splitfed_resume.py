"""A SplitFed consortium that stops after round k resumes at round k + 1 --
the global segments, the shared backbone, each party's optimizer and data
position, the strategy's state -- and ends where an uninterrupted run ends."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from sigkill import kill_once

from aisyn.fl.federation import FEDERATION_FILE
from aisyn.fl.settings import FLSettings
from aisyn.splitfed import grid as splitfed
from aisyn.splitfed.run import run_splitfed
from aisyn.train import checkpoint as ckpt
from aisyn.train.run import read_metrics

LOCAL = dict(batch_size=4, micro_batch_size=2, lr=2e-3, warmup=1, seed=11)


def settings(**kw) -> FLSettings:
    d = dict(
        rounds=3,
        local_steps=2,
        min_clients=2,
        eval_items=8,
        device="cpu",
        strategy="fedadam",
        **LOCAL,
    )
    return FLSettings.from_dict(d | kw)


class Killed(Exception):
    """The coordinator 'dies' here (a test stand-in for SIGKILL)."""


def dying(monkeypatch, calls: int) -> None:
    """The consortium dies before its ``calls``-th exchange with the parties
    (a round is two: train, then evaluate, which only the last round sends)."""
    real = splitfed.MembersGrid.send_and_receive
    left = [calls]

    def send_and_receive(self, messages, *, timeout=None):
        if left[0] == 0:
            raise Killed
        left[0] -= 1
        return real(self, messages, timeout=timeout)

    monkeypatch.setattr(splitfed.MembersGrid, "send_and_receive", send_and_receive)


def losses(run: Path) -> list[tuple[int, float]]:
    return [
        (r["step"], r["loss"])
        for r in read_metrics(run / "metrics.jsonl")
        if "loss" in r
    ]


@pytest.fixture(scope="module")
def parties(ft_sft_dir, tmp_path_factory) -> dict[str, Path]:
    """Two parties (one domain's items each: the run's state is what matters)."""
    return {"a": ft_sft_dir, "b": ft_sft_dir}


@pytest.fixture(scope="module")
def whole(tmp_path_factory, ft_base, parties) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("whole") / "run"
    return out, run_splitfed(ft_base, parties, out, settings(), log_every=1)


@pytest.mark.heavy
def test_a_consortium_that_dies_after_round_2_resumes_and_ends_bit_exact(
    monkeypatch, tmp_path, whole, ft_base, parties
):
    # Prepare: a run that dies as round 3 begins
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        dying(m, 4)
        with pytest.raises(Killed):
            run_splitfed(ft_base, parties, out, settings(), log_every=1)
    assert ckpt.read_state(ckpt.latest(out / "global" / "checkpoints"))["round"] == 2
    # Execute
    resumed = run_splitfed(ft_base, parties, out, settings(), log_every=1, resume=True)
    # Assert: the same model, bit for bit, and the same record of the run
    whole_out, whole_summary = whole
    a = ckpt.read_tensors(ckpt.model_file(out / "merged"))
    b = ckpt.read_tensors(ckpt.model_file(whole_out / "merged"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in parties:
        assert losses(out / "parties" / name) == losses(whole_out / "parties" / name)
    for key in ("final_global_valid_loss", "backbone_steps"):
        assert resumed[key] == whole_summary[key], key
    # the same cut tensors crossed; the sessions' own frames (opening, closing)
    # are those of the sessions each run had
    assert abs(resumed["link_bytes"] - whole_summary["link_bytes"]) <= 64 * 2
    keys = ("round", "accepted", "train_loss", "step", "link_bytes")
    assert [{k: h.get(k) for k in keys} for h in resumed["history"]] == [
        {k: h.get(k) for k in keys} for h in whole_summary["history"]
    ]
    assert [r["round"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 3]


@pytest.mark.heavy
def test_a_consortium_killed_with_sigkill_resumes_and_ends_bit_exact(
    tmp_path, whole, ft_base, parties
):
    # Prepare: the consortium in its own process, killed once a round is saved
    out = tmp_path / "run"
    script = Path(__file__).parent / "splitfed_proc.py"
    args = [sys.executable, str(script), str(ft_base), str(out)]
    args += [f"{k}={v}" for k, v in sorted(parties.items())]
    kill_once(args, out / "global" / "checkpoints" / "latest")
    saved = ckpt.read_state(ckpt.latest(out / "global" / "checkpoints"))["round"]
    # Execute
    resumed = run_splitfed(ft_base, parties, out, settings(), log_every=1, resume=True)
    # Assert
    whole_out, whole_summary = whole
    a = ckpt.read_tensors(ckpt.model_file(out / "merged"))
    b = ckpt.read_tensors(ckpt.model_file(whole_out / "merged"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (
        resumed["final_global_valid_loss"] == whole_summary["final_global_valid_loss"]
    )
    assert [h["round"] for h in resumed["history"]] == [1, 2, 3]
    assert resumed["resumed_at_round"] == saved + 1


def test_resume_with_other_settings_or_no_run_is_refused(
    tmp_path, whole, ft_base, parties
):
    whole_out, _ = whole
    copy = tmp_path / "copy"
    shutil.copytree(whole_out, copy)
    before = {p: p.read_bytes() for p in sorted(copy.rglob("*")) if p.is_file()}
    with pytest.raises(ValueError, match=r"other settings \(lr\)"):
        run_splitfed(ft_base, parties, copy, settings(lr=1e-3), resume=True)
    with pytest.raises(ValueError, match="other parties"):
        run_splitfed(
            ft_base, {"a": parties["a"]}, copy, settings(min_clients=1), resume=True
        )
    latest = ckpt.latest(copy / "global" / "checkpoints")
    state = latest / FEDERATION_FILE
    state.write_bytes(state.read_bytes()[:64])
    before[state] = state.read_bytes()
    with pytest.raises(ckpt.CheckpointError, match="corrupt safetensors file"):
        run_splitfed(ft_base, parties, copy, settings(), resume=True)
    after = {p: p.read_bytes() for p in sorted(copy.rglob("*")) if p.is_file()}
    assert after == before
    with pytest.raises(ValueError, match="holds no SplitFed run"):
        run_splitfed(ft_base, parties, tmp_path / "none", settings(), resume=True)
    config = json.loads((copy / "config.json").read_text())
    assert config["kind"] == "splitfed"

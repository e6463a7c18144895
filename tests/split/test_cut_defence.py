"""Defences on the cut (``train.dp``): the mechanisms do what they say, the
budget is the accountant's, a defended split run is reproducible and resumes
exactly, the compute party is never told, and nonsense settings are refused."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from conftest import CUT, losses, train_cfg
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from aisyn.split.client.train import split_train
from aisyn.split.defence import cut_dp as dp
from aisyn.split.session import COMPUTE_DIR, SplitOptions
from aisyn.train.run import RunDir, read_metrics


def test_clip_rows_bounds_each_row_and_keeps_small_ones():
    x = torch.randn(4, 8, 16)
    x[0] *= 100
    x[1] *= 1e-3
    y = dp.clip_rows(x, 1.0)
    norms = y.flatten(1).norm(dim=1)
    assert norms[0] == pytest.approx(1.0, rel=1e-5)
    assert torch.equal(y[1], x[1])  # already inside the bound: untouched
    assert bool((norms <= 1.0 + 1e-5).all())


def test_clip_rows_passes_the_gradient_of_the_scaled_rows():
    x = (torch.randn(2, 3, 4) * 10).requires_grad_()
    dp.clip_rows(x, 1.0).sum().backward()
    scale = 1.0 / x.detach().flatten(1).norm(dim=1)
    # d/dx of x * c, c treated as a constant of the row (as DP-SGD clips)
    assert torch.allclose(x.grad, scale.view(2, 1, 1).expand(2, 3, 4))


def test_gaussian_noise_has_the_asked_std_and_follows_the_secret():
    guard = dp.CutGuard(dp.CutDefence(forward=dp.Gaussian(1.0, 2.0)), secret=7)
    h = torch.zeros(8, 64, 32)
    a = guard.activations(h, 3, 0)
    assert a.std().item() == pytest.approx(2.0, rel=0.02)
    assert torch.equal(a, guard.activations(h, 3, 0))  # same round: same draw
    assert not torch.equal(a, guard.activations(h, 3, 1))  # another micro-batch
    other = dp.CutGuard(guard.defence, secret=8).activations(h, 3, 0)
    assert not torch.equal(a, other)


def test_embedding_dp_flips_bits_at_its_rate_and_is_straight_through():
    eps = 2.0
    guard = dp.CutGuard(dp.CutDefence(embedding_dp=eps), secret=1)
    x = torch.randn(16, 32, 64, requires_grad=True)
    sent = guard.activations(x, 0, 0)
    bits = (x.detach() > 0).float()
    assert set(sent.detach().unique().tolist()) <= {0.0, 1.0}
    flipped = (sent.detach() != bits).float().mean().item()
    assert flipped == pytest.approx(1 / (1 + math.exp(eps / 2)), abs=0.01)
    g = torch.randn_like(x)
    sent.backward(g)
    assert torch.equal(x.grad, g)


def test_epsilon_is_the_accountants():
    d = dp.CutDefence(forward=dp.Gaussian(1.0, 4.0), backward=dp.Gaussian(2.0, 2.0))
    want = rdp_privacy_accountant.RdpAccountant()
    want.compose(dp_event.GaussianDpEvent(2.0), 3)  # replace-one: noise / 2
    want.compose(dp_event.GaussianDpEvent(1.0), 3)
    assert dp.epsilon(d, 3) == pytest.approx(want.get_epsilon(1e-5))
    assert dp.epsilon(d, 0) == 0.0
    assert dp.epsilon(d, 2) < dp.epsilon(d, 3)  # more passes, more spent
    forward_only = rdp_privacy_accountant.RdpAccountant()
    forward_only.compose(dp_event.GaussianDpEvent(2.0), 3)
    assert dp.epsilon(d, 3, backward=False) == pytest.approx(
        forward_only.get_epsilon(1e-5)
    )
    # A side that crosses without noise has no bound.
    assert dp.epsilon(dp.CutDefence(forward=dp.Gaussian(1.0, 1.0)), 1) == math.inf
    assert dp.epsilon(dp.CutDefence(forward=dp.Gaussian(1.0, 0.0)), 1) == math.inf
    # EmbeddingDP: pure ε per bit, composed over a row's bits and its passes,
    # plus the backward Gaussian's.
    e = dp.CutDefence(embedding_dp=0.5, backward=dp.Gaussian(1.0, 4.0))
    backward_only = rdp_privacy_accountant.RdpAccountant()
    backward_only.compose(dp_event.GaussianDpEvent(2.0), 2)
    assert dp.epsilon(e, 2, coordinates=10) == pytest.approx(
        0.5 * 10 * 2 + backward_only.get_epsilon(1e-5)
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"forward_noise": 1.0}, "--dp-forward-noise needs --dp-forward-clip"),
        ({"backward_noise": 1.0}, "--dp-backward-noise needs --dp-backward-clip"),
        ({"forward_clip": 1.0, "delta": 1e-6}, "--dp-delta: no Gaussian noise"),
        ({"forward_clip": 0.0, "forward_noise": 1.0}, "clip must be positive"),
        ({"forward_clip": 1.0, "forward_noise": -1.0}, "noise must be >= 0"),
        ({"forward_clip": 1.0, "forward_noise": 1.0, "delta": 1.0}, "delta must be"),
        ({"embedding_dp": 0.0}, "embedding-dp epsilon must be positive"),
        ({"embedding_dp": 1.0, "forward_clip": 1.0}, "choose one"),
    ],
)
def test_nonsense_settings_are_refused_in_one_line(flags, message):
    with pytest.raises(ValueError, match=message) as e:
        dp.defence_from_flags(**flags)
    assert "\n" not in str(e.value)


def _run(out, news_data, split_config, defence, **cfg):
    return split_train(
        split_config,
        [news_data],
        out,
        train_cfg(**cfg),
        SplitOptions(cut=CUT, mode="local"),
        progress=False,
        defence=defence,
    )


@pytest.mark.heavy
def test_a_bound_that_never_binds_leaves_the_run_exact(
    tmp_path, news_data, split_config, baseline
):
    loose = dp.CutDefence(forward=dp.Gaussian(1e9), backward=dp.Gaussian(1e9))
    summary = _run(tmp_path / "run", news_data, split_config, loose)
    assert losses(tmp_path / "run") == pytest.approx(baseline, rel=1e-5)
    assert summary["privacy"]["dp_epsilon"] is None  # clipped, but no noise


def test_defended_run_reports_its_budget_and_b_is_not_told(
    tmp_path, news_data, split_config, baseline
):
    # Prepare
    defence = dp.CutDefence(
        forward=dp.Gaussian(50.0, 0.01), backward=dp.Gaussian(0.05, 0.5), delta=1e-6
    )
    out = tmp_path / "run"
    # Execute
    summary = _run(out, news_data, split_config, defence, steps=12)
    # Assert: the noise reaches B from the first forward on, and it trains
    got = losses(out)
    assert all(math.isfinite(v) for v in got)
    assert got[0] != pytest.approx(baseline[0], rel=1e-6)
    assert abs(got[0] - baseline[0]) < 0.5  # noise of 1 % of the clip
    records = read_metrics(out / "metrics.jsonl")
    k = summary["privacy"]["releases_per_row"]
    assert k >= 1
    assert records[-1]["dp_epsilon"] == pytest.approx(dp.epsilon(defence, k))
    saved = json.loads((out / "privacy.json").read_text())
    assert saved["dp_epsilon"] == pytest.approx(dp.epsilon(defence, k))
    assert saved["delta"] == 1e-6
    config = json.loads((out / "config.json").read_text())
    assert dp.CutDefence.from_dict(config["cut_defence"]) == defence
    # B's side of the run (in-process: under A's folder) holds no trace of it.
    b_files = list((out / COMPUTE_DIR).rglob("*.json"))
    assert b_files, "the compute party wrote no run folder"
    for f in b_files:
        text = f.read_text()
        assert "cut_defence" not in text and "noise" not in text, f


@pytest.mark.heavy
def test_defended_run_is_reproducible_and_resumes_exactly(
    tmp_path, news_data, split_config
):
    defence = dp.CutDefence(
        forward=dp.Gaussian(50.0, 0.01), backward=dp.Gaussian(0.05, 0.5)
    )
    whole, again, part = tmp_path / "whole", tmp_path / "again", tmp_path / "part"
    _run(whole, news_data, split_config, defence, steps=10, ckpt_every=5)
    _run(again, news_data, split_config, defence, steps=10, ckpt_every=5)
    assert losses(again) == losses(whole)
    _run(part, news_data, split_config, defence, steps=5, ckpt_every=5)
    split_train(
        split_config,
        [news_data],
        part,
        train_cfg(steps=10, ckpt_every=5),
        SplitOptions(cut=CUT, mode="local"),
        progress=False,
        defence=defence,
        resume=True,
    )
    assert losses(part) == losses(whole)
    # Resuming under another defence would break the budget's accounting.
    with pytest.raises(ValueError, match="resume it with the same defence"):
        split_train(
            split_config,
            [news_data],
            part,
            train_cfg(steps=12, ckpt_every=5),
            SplitOptions(cut=CUT, mode="local"),
            progress=False,
            resume=True,
        )


class _GuardedGradient(torch.autograd.Function):
    """The identity forward; backward: what A's guard sends B instead."""

    @staticmethod
    def forward(ctx, x, guard, where):
        ctx.guard, ctx.where = guard, where
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.guard.gradient(g, *ctx.where), None, None


@pytest.mark.heavy
def test_noise_touches_only_what_b_adds_not_the_residual_stream(
    tmp_path, news_data, split_config, monkeypatch
):
    """Under a defence, A puts its own residual stream back into B's answer:
    B's blocks compute on the noised activations and get the noised gradient,
    A's layers read ``clean + Δ(sent)`` and A's front gets its own gradient
    through the residual. The same arithmetic, written in the unsplit model
    (B's blocks 1-2 wrapped, the same noise drawn), trains identically."""
    from aisyn.model.pangu import PanguAlpha
    from aisyn.train.pretrain import train

    defence = dp.CutDefence(
        forward=dp.Gaussian(50.0, 0.02), backward=dp.Gaussian(0.05, 0.5)
    )
    cfg = train_cfg(steps=6)
    _run(tmp_path / "split", news_data, split_config, defence, steps=6)
    guard = dp.CutGuard(defence, cfg.seed)  # the secret split_train keys it with
    micro_per_step = cfg.batch_size // cfg.micro_batch_size
    calls = {"n": 0}
    original = PanguAlpha.block

    def block(self, i, x, ctx, kv=None):
        if i == 1:  # B's first block: it sees what A sends
            n = calls["n"]
            calls["n"] += 1
            calls["where"] = (n // micro_per_step, n % micro_per_step)
            calls["clean"] = x
            calls["sent"] = guard.activations(x, *calls["where"])
            return original(self, 1, calls["sent"], ctx, kv)
        if i == 2:  # B's last block: A restores its residual stream
            delta = original(self, 2, x, ctx, kv) - calls["sent"]
            return _GuardedGradient.apply(delta, guard, calls["where"]) + calls["clean"]
        return original(self, i, x, ctx, kv)

    monkeypatch.setattr(PanguAlpha, "block", block)
    train(split_config, [news_data], tmp_path / "whole", cfg, progress=False)
    assert calls["n"] == 6 * micro_per_step
    assert losses(tmp_path / "split") == pytest.approx(
        losses(tmp_path / "whole"), rel=1e-5
    )


# --- split train --defence ------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            {"named": "recommended", "forward_clip": 1.0},
            "--defence recommended and --dp-forward-clip contradict each other",
        ),
        (
            {"named": "recommended", "backward_noise": 0.3, "embedding_dp": 5.0},
            "--defence recommended and --dp-backward-noise, --embedding-dp",
        ),
        ({"named": "none", "delta": 1e-6}, "--defence none and --dp-delta contradict"),
        ({"named": "strong"}, "--defence strong: expected one of"),
    ],
)
def test_a_named_defence_with_flags_that_change_it_is_refused(flags, message):
    with pytest.raises(ValueError, match=message) as e:
        dp.defence_from_flags(**flags)
    assert "\n" not in str(e.value)


def test_a_named_defence_is_the_request_it_names():
    assert dp.defence_from_flags(named="recommended") == dp.Recommended()
    # δ only changes where ε is reported: it may join the recommended defence
    assert dp.defence_from_flags(named="recommended", delta=1e-6).delta == 1e-6
    with pytest.raises(ValueError, match="delta must be positive"):
        dp.Recommended(0.0)
    assert dp.defence_from_flags(named="none") == dp.CutDefence()
    # no flag at all: the safe default, which a resume does not second-guess
    assert dp.defence_from_flags() == dp.Recommended(implied=True)
    assert dp.defence_from_flags(delta=1e-6) == dp.Recommended(1e-6, implied=True)


def _split_cli(tmp_path, news_data, split_config, out, *flags):
    from aisyn.cli import main

    model = tmp_path / "model.json"
    model.write_text(json.dumps(split_config.to_dict()))
    cfg = train_cfg()
    argv = ["split", "train", "--model", str(model), "--data", str(news_data)]
    argv += ["--out", str(out), "--cut", CUT, "--quiet", "--device", "cpu"]
    argv += ["--steps", "4", "--batch-size", str(cfg.batch_size)]
    argv += ["--micro-batch-size", str(cfg.micro_batch_size), "--lr", str(cfg.lr)]
    argv += ["--warmup", "1", "--log-every", "1", "--seed", str(cfg.seed), *flags]
    return main(argv)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.heavy
def test_the_default_defence_is_the_recommended_one_and_the_run_of_its_flags(
    tmp_path, news_data, split_config, caplog, monkeypatch
):
    """With no defence flag, split train runs --defence recommended: it
    calibrates at the run's start (the seeded init) on the built-in public
    text, as train.dp_calibration does for `privacy calibrate`, and then runs
    exactly what the printed --dp-* flags run."""
    import aisyn.split.defence.attach

    # 16 public rows instead of 256: two calibration steps keep the test fast
    monkeypatch.setattr(aisyn.split.defence.attach, "CALIBRATION_ROWS", 16)
    from aisyn.data.tokenizer import open_tokenizer
    from aisyn.model.families import build_model
    from aisyn.split.defence.calibration import calibrate, public_rows

    caplog.set_level(logging.INFO)
    # Execute: no defence flag at all
    named = tmp_path / "default"
    assert _split_cli(tmp_path, news_data, split_config, named) in (0, None)
    # Assert: the recommended noise, the bounds of the public text at the start
    used = dp.CutDefence.from_dict(
        json.loads((named / "config.json").read_text())["cut_defence"]
    )
    assert (used.forward.noise, used.backward.noise) == (
        dp.RECOMMENDED.forward,
        dp.RECOMMENDED.backward,
    )
    tok = json.loads((news_data / "manifest.json").read_text())["tokenizer"]
    rows = public_rows(open_tokenizer(news_data / tok["file"], tok), 32, 16)
    assert rows.shape == (16, 33)
    start = (
        build_model(split_config, seed=train_cfg().seed).eval().requires_grad_(False)
    )
    clips = calibrate(start, rows, CUT, train_cfg().batch_size)
    assert (used.forward.clip, used.backward.clip) == (clips.forward, clips.backward)
    # the user is told what it turned on, and no undefended warning
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("cut defence: recommended, calibrated on 16 rows")
        and f"--dp-forward-clip {clips.forward!r}" in m
        for m in messages
    )
    assert not any("no cut defence" in m for m in messages)
    caplog.clear()
    # Execute: the same defence spelled out
    explicit = tmp_path / "explicit"
    flags = ["--dp-forward-clip", repr(clips.forward), "--dp-forward-noise", "0.1"]
    flags += ["--dp-backward-clip", repr(clips.backward), "--dp-backward-noise", "0.3"]
    assert _split_cli(tmp_path, news_data, split_config, explicit, *flags) in (0, None)
    # Assert: the same run, step for step, and the same budget
    assert losses(explicit) == losses(named)
    privacy = [json.loads((d / "privacy.json").read_text()) for d in (named, explicit)]
    assert privacy[0] == privacy[1]
    assert not any("no cut defence" in m for m in _warnings(caplog))


def test_an_undefended_run_says_at_start_what_it_exposes(
    tmp_path, news_data, split_config, caplog
):
    out = tmp_path / "open"
    argv = ["--steps", "1", "--defence", "none"]
    assert _split_cli(tmp_path, news_data, split_config, out, *argv) in (0, None)
    warnings = _warnings(caplog)
    line = warnings[0]  # the first thing it says
    assert line.startswith("--defence none: no cut defence")
    assert "\n" not in line
    assert "68% of the input tokens and 96% of the labels" in line
    assert "leave --defence out for the default" in line
    assert RunDir(out).read_config()["cut_defence"] == dp.CutDefence().to_dict()
    # its small seed is guessable: the warning says what that costs, noise too
    [seed] = [w for w in warnings if w.startswith("--seed 11")]
    assert "cut defence's noise, which is drawn from the seed" in seed


def test_a_named_defence_with_contradicting_flags_writes_nothing(
    tmp_path, news_data, split_config, capsys
):
    out = tmp_path / "run"
    rc = _split_cli(
        tmp_path,
        news_data,
        split_config,
        out,
        "--defence",
        "recommended",
        "--dp-backward-noise",
        "1",
    )
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "aisyn: error: --defence recommended and --dp-backward-noise contradict"
    )
    assert not out.exists()


def test_a_resumed_recommended_run_keeps_the_bounds_it_started_with(tmp_path):
    """Its budget spans the run: resuming reads the recorded bounds instead of
    calibrating again (the weights have moved), and refuses another defence."""
    from aisyn.split.defence.attach import recorded_defence
    from aisyn.train.run import RunDir

    started = dp.recommended_defence(0.9, 0.08, delta=1e-6)
    RunDir(tmp_path / "run").create({"cut_defence": started.to_dict()}, resume=False)
    assert recorded_defence(dp.Recommended(1e-6), tmp_path / "run") == started
    with pytest.raises(ValueError, match="not --defence recommended") as e:
        recorded_defence(dp.Recommended(), tmp_path / "run")  # another delta
    assert "\n" not in str(e.value)
    RunDir(tmp_path / "open").create({"cut_defence": None}, resume=False)
    with pytest.raises(ValueError, match="trained with cut defence none"):
        recorded_defence(dp.Recommended(), tmp_path / "open")
    # no defence flag on --resume: the run keeps the defence it started with
    implied = dp.Recommended(implied=True)
    assert recorded_defence(implied, tmp_path / "open") == dp.CutDefence()
    assert recorded_defence(implied, tmp_path / "run") == started

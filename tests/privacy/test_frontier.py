"""The frontier: a defence measured by a real split run's loss and by the
attacks on what it lets cross; the recommended default; the audit's bad
input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from aisyn.cli import main
from aisyn.data.shards import TokenShards
from aisyn.privacy.frontier import Point
from aisyn.train.config import TrainConfig


@pytest.mark.heavy
def test_noise_on_the_cut_hides_the_labels_the_undefended_run_gives_away(
    tmp_path, base, news_data, news_sft, reviews_data, tokenizer, tiny_inverter
):
    """Two real split runs of the yardstick: undefended, B reads the labels
    from the gradient early and late; under σ = 1 both ways it is down to
    guessing, with a finite ε and the same bytes on the link."""
    from aisyn.data.sft import SFTData
    from aisyn.eval.cloze import encode_items
    from aisyn.privacy.yardstick import UNDEFENDED, Config, Inputs, measure
    from aisyn.split.defence.calibration import calibrate
    from aisyn.train.models import load_run_model

    # Prepare: B's public rows and A's private rows
    base_model, _ = load_run_model(base)
    public = TokenShards.open(reviews_data, "train").batch(torch.arange(32))
    inputs = Inputs(
        mcfg=base_model.config,
        base=base,
        data=news_data,
        sft=news_sft,
        cloze=encode_items(
            SFTData.open(news_sft, "train").test_items()[:2], tokenizer, 32, "prompt"
        ),
        pad_id=tokenizer.pad_id,
        rows=TokenShards.open(news_data, "test").batch(torch.arange(2)),
        public_rows=public,
        cut="u:1,1",
        eval_batches=2,
        attack_steps=20,
        inverter=tiny_inverter,
        known_rows=TokenShards.open(news_data, "train").batch(torch.arange(8)),
    )
    clips = calibrate(base_model, public, "u:1,1", 8)
    cfg = TrainConfig(
        steps=4, batch_size=8, lr=1e-3, warmup_steps=1, seed=5, device="cpu"
    )
    # Execute
    noise = Config("noise", forward=1.0, backward=1.0)
    got = {
        c.name: measure(c, 5, inputs, clips, cfg, tmp_path / c.name)
        for c in (UNDEFENDED, noise)
    }
    # Assert: per configuration, A's weights x direction
    rows = {
        (name, a["A_weights"], a["direction"]): a
        for name, r in got.items()
        for a in r["attacks"]
    }
    assert len(rows) == 8
    for weights in ("base (early)", "trained (late)"):
        open_labels = rows[("undefended", weights, "backward")]
        assert open_labels["recovery"] > open_labels["frequent_token"] + 0.2
        hidden = rows[("noise", weights, "backward")]
        assert hidden["recovery"] <= hidden["frequent_token"] + 0.05
    assert got["undefended"]["dp_epsilon"] is None
    assert got["noise"]["dp_epsilon"] is not None and got["noise"]["dp_epsilon"] > 0
    assert got["noise"]["bytes_per_step"] == got["undefended"]["bytes_per_step"]
    assert math.isfinite(got["noise"]["loss"])
    assert (tmp_path / "noise" / "run" / "privacy.json").is_file()


def test_audit_without_a_preset_or_inputs_says_what_is_missing(tmp_path, capsys):
    rc = main(["privacy", "audit", "--out", str(tmp_path / "o"), "--base", "x"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("aisyn: error: give --preset ci|full, or --data, --public"), err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_ci_preset_measures_every_piece(tmp_path, capsys):
    """Every piece, ending with the summary line scripts read; --resume then
    reuses every trained run and ends with the same line."""
    from test_yardstick import LINE

    out = tmp_path / "audit"
    argv = ["privacy", "audit", "--preset", "ci", "--out", str(out)]
    assert main(argv) in (0, None)
    for name in ("frontier.md", "frontier.csv", "frontier.json", "frontier.png"):
        assert (out / name).is_file(), name
    assert (out / "cuts" / "audit.md").is_file()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert LINE.fullmatch(last), last
    report = json.loads((out / "frontier.json").read_text())
    assert report["base"]["loss"] > report["rows"][0]["loss"]  # fine-tuning gains
    assert main([*argv, "--resume"]) in (0, None)
    kept = json.loads((out / "frontier.json").read_text())["rows"][0]["kept_loss"]
    assert kept == report["rows"][0]["kept_loss"]


def test_calibrate_prints_flags_split_train_takes(base, reviews_data, capsys):
    from aisyn.split.defence.calibration import calibrate
    from aisyn.split.defence.cut_dp import defence_from_flags
    from aisyn.train.models import load_run_model

    argv = ["privacy", "calibrate", "--base", str(base), "--public"]
    argv += [str(reviews_data), "--batch-size", "4", "--samples", "8"]
    argv += ["--backward-noise", "0.2"]
    assert main(argv) in (0, None)
    flags = capsys.readouterr().out.split()
    values = dict(zip(flags[::2], flags[1::2], strict=True))
    # the medians of the same rows, measured directly
    model, _ = load_run_model(base)
    g = torch.Generator().manual_seed(0)
    public = TokenShards.open(reviews_data, "train")
    rows = public.batch(torch.randperm(len(public), generator=g)[:8])
    clips = calibrate(model.eval().requires_grad_(False), rows, "u:1,1", 4)
    assert float(values["--dp-forward-clip"]) == pytest.approx(clips.forward, rel=1e-5)
    assert float(values["--dp-backward-clip"]) == pytest.approx(
        clips.backward, rel=1e-5
    )
    defence = defence_from_flags(
        forward_clip=float(values["--dp-forward-clip"]),
        forward_noise=float(values["--dp-forward-noise"]),
        backward_clip=float(values["--dp-backward-clip"]),
        backward_noise=float(values["--dp-backward-noise"]),
    )
    # the recommended forward noise by default; --backward-noise as asked
    assert (defence.forward.noise, defence.backward.noise) == (0.1, 0.2)
    # 0 leaves a direction out
    assert main([*argv, "--forward-noise", "0"]) in (0, None)
    assert "--dp-forward" not in capsys.readouterr().out


def test_a_point_names_and_builds_its_defence():
    from aisyn.privacy.frontier import defence_for
    from aisyn.split.defence.calibration import Clips

    clips = Clips(forward=600.0, backward=0.001)
    both = Point("gaussian", forward=0.1, backward=0.1)
    assert both.label == "Gaussian σ=0.1 both ways"
    d = defence_for(both, clips)
    assert (d.forward.clip, d.forward.noise) == (600.0, 0.1)
    assert (d.backward.clip, d.backward.noise) == (0.001, 0.1)
    mixed = Point("gaussian", forward=0.1, backward=0.3)
    assert mixed.label == "Gaussian σ=0.1 on the activations, σ=0.3 on the gradient"
    grad_only = Point("gaussian", cut="u:2,0", backward=0.3)
    assert grad_only.label == "Gaussian σ=0.3 on the gradient, cut u:2,0"
    d = defence_for(grad_only, clips)
    assert d.forward is None and d.backward.noise == 0.3
    assert not defence_for(Point("blocks", cut="u:2,0"), clips).active
    assert (
        defence_for(Point("embedding-dp", embedding_eps=5.0), clips).embedding_dp == 5
    )


def test_a_preset_refuses_the_flags_it_would_ignore(tmp_path, capsys):
    out = tmp_path / "o"
    argv = ["privacy", "audit", "--preset", "ci", "--out", str(out)]
    argv += ["--base", "b", "--public", "p", "--samples", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "aisyn: error: --preset ci measures on the comparison's own base, data and "
        "settings; drop --base, --public, --samples (or --preset, to audit your own)"
    )
    assert not out.exists()


def test_calibrate_refuses_a_cut_split_training_refuses(base, capsys):
    argv = ["privacy", "calibrate", "--base", str(base), "--cut", "two-way:1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "aisyn: error: --cut two-way:1: split training needs a U-shape cut "
        "(u:FRONT,BACK) so that labels and the loss stay with the data party"
    )


def test_calibrate_without_public_shards_reads_the_built_in_public_text(base, capsys):
    """The same rows `split train --defence recommended` calibrates on, and
    the bounds printed exactly (the flags then give that run)."""
    from aisyn.data.tokenizer import open_tokenizer
    from aisyn.split.defence.calibration import calibrate, public_rows
    from aisyn.train.models import load_run_model
    from aisyn.train.run import TOKENIZER, RunDir

    argv = ["privacy", "calibrate", "--base", str(base), "--batch-size", "4"]
    assert main([*argv, "--samples", "16"]) in (0, None)
    flags = capsys.readouterr().out.split()
    values = dict(zip(flags[::2], flags[1::2], strict=True))
    model, config = load_run_model(base)
    tok = open_tokenizer(RunDir(base).path / TOKENIZER, config["tokenizer"])
    rows = public_rows(tok, 32, 16)
    clips = calibrate(model.eval().requires_grad_(False), rows, "u:1,1", 4)
    assert values["--dp-forward-clip"] == repr(clips.forward)
    assert values["--dp-backward-clip"] == repr(clips.backward)
    assert (values["--dp-forward-noise"], values["--dp-backward-noise"]) == (
        "0.1",
        "0.3",
    )


@pytest.mark.heavy
def test_defence_recommended_from_a_base_runs_the_flags_calibrate_prints(
    tmp_path, base, news_data, capsys, monkeypatch
):
    """From a public base, `split train --defence recommended` calibrates on
    the whole base (B's blocks too) and the built-in public text: exactly the
    bounds `privacy calibrate --base` prints for the same batch size (and, to
    keep this fast, the same 16 rows instead of 256)."""
    import aisyn.split.defence.attach
    from aisyn.split.defence import cut_dp as dp
    from aisyn.train.models import load_run_model

    monkeypatch.setattr(aisyn.split.defence.attach, "CALIBRATION_ROWS", 16)
    argv = ["privacy", "calibrate", "--base", str(base), "--batch-size", "4"]
    argv += ["--samples", "16"]
    assert main(argv) in (0, None)
    flags = capsys.readouterr().out.split()
    printed = dict(zip(flags[::2], flags[1::2], strict=True))
    model = tmp_path / "model.json"
    model.write_text(json.dumps(load_run_model(base)[0].config.to_dict()))
    out = tmp_path / "run"
    argv = ["split", "train", "--model", str(model), "--data", str(news_data)]
    argv += ["--init-from", str(base), "--out", str(out), "--defence", "recommended"]
    argv += ["--steps", "1", "--batch-size", "4", "--device", "cpu", "--quiet"]
    assert main(argv) in (0, None)
    config = json.loads((out / "config.json").read_text())
    used = dp.CutDefence.from_dict(config["cut_defence"])
    assert repr(used.forward.clip) == printed["--dp-forward-clip"]
    assert repr(used.backward.clip) == printed["--dp-backward-clip"]
    assert f"{used.forward.noise:g}" == printed["--dp-forward-noise"]
    assert f"{used.backward.noise:g}" == printed["--dp-backward-noise"]
    assert config["init_from"] is not None

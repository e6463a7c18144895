"""The trained bottleneck at the cut (``split.defence.bottleneck``): its per-token
clip holds against a front that scales up, its noise never falls below the
floor, its capacity term and bound are the Gaussian channel's, and a split
run trains it (through B's Jacobian, or the emulator with B frozen), saves it
with A's checkpoint only, resumes to the uninterrupted losses and refuses
what contradicts it in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import CUT, losses, train_cfg

import aisyn.split.defence.attach
from aisyn.split.client.train import split_train
from aisyn.split.defence import cut_dp as dp
from aisyn.split.defence.bottleneck import Bottleneck, BottleneckSpec, water_filling
from aisyn.split.session import COMPUTE_DIR, SplitOptions
from aisyn.train import checkpoint as ckpt
from aisyn.train.pretrain import train

H, T = 16, 6


def calibrated(floor=2.0, beta=0.01) -> Bottleneck:
    b = Bottleneck(BottleneckSpec(floor, beta), seq_len=8, hidden=H)
    b.calibrate(torch.randn(64, T, H, generator=torch.Generator().manual_seed(0)))
    return b


def noise_free(b: Bottleneck, h: torch.Tensor) -> torch.Tensor:
    """What ``b`` sends for ``h`` minus its noise: the same draw, subtracted."""
    sent, _ = b(h, torch.Generator().manual_seed(9))
    noise = torch.randn(h.shape, generator=torch.Generator().manual_seed(9))
    return (sent - noise * b.sigma() * b.radius / math.sqrt(H)).detach()


def test_each_token_is_clipped_however_far_the_front_scales_up():
    b = calibrated()
    h = torch.randn(3, T, H)
    for scale in (1.0, 1e3, 1e6):
        z = noise_free(b, h * scale) - b.centre[:T]
        assert float(z.norm(dim=-1).max()) <= float(b.radius) * (1 + 1e-5)
    # a token already inside the bound crosses unscaled
    small = b.centre[:T] + 0.1 * b.radius * torch.eye(H)[:T]
    torch.testing.assert_close(noise_free(b, small[None]), small[None])


def test_the_noise_never_falls_below_the_floor_and_the_term_falls_as_it_grows():
    b = calibrated(floor=3.0)
    h = torch.randn(2, T, H) * 5
    terms = []
    for rho in (-100.0, 0.0, 5.0):
        with torch.no_grad():
            b.rho.fill_(rho)
        assert float(b.sigma().min()) >= 3.0
        terms.append(float(b(h, torch.Generator().manual_seed(1))[1]))
    assert terms[0] > terms[1] > terms[2] > 0


def test_the_capacity_bound_is_the_water_filling_one_and_bounds_the_term():
    # equal noise: every channel filled alike, H/2 log(1 + 1/σ²)
    got = water_filling(torch.full((H,), 4.0, dtype=torch.float64), float(H))
    assert got == pytest.approx(H / 2 * math.log1p(1 / 4.0))
    # one quiet channel takes all the power when the others are far louder
    noise = torch.tensor([1.0, 1e6, 1e6], dtype=torch.float64)
    assert water_filling(noise, 3.0) == pytest.approx(0.5 * math.log(4.0))
    b = calibrated(floor=1.5, beta=1.0)
    with torch.no_grad():
        b.rho.copy_(torch.linspace(-3, 3, H))
    for scale in (0.1, 1.0, 100.0):  # whatever the front sends within the clip
        _, term = b(torch.randn(4, T, H) * scale, torch.Generator().manual_seed(2))
        assert float(term) <= b.capacity_bound() + 1e-6
    record = b.record()
    assert (
        record["capacity_bound_nats_per_token"]
        <= (record["capacity_at_floor_nats_per_token"])
    )


def test_its_noise_is_drawn_from_the_secret_and_the_round():
    b = calibrated()
    defence = dp.CutDefence(bottleneck=b.spec)
    h = torch.randn(2, T, H)
    one, again = dp.CutGuard(defence, 5, b), dp.CutGuard(defence, 5, b)
    torch.testing.assert_close(one.activations(h, 1, 0), again.activations(h, 1, 0))
    assert not torch.equal(one.activations(h, 1, 0), one.activations(h, 1, 1))
    other = dp.CutGuard(defence, 6, b)
    assert not torch.equal(one.activations(h, 1, 0), other.activations(h, 1, 0))
    with pytest.raises(ValueError, match="runs with its module"):
        dp.CutGuard(defence, 5)


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(bottleneck_floor=0.0), "--bottleneck-floor must be positive"),
        (dict(bottleneck_floor=math.nan), "--bottleneck-floor must be"),
        (dict(bottleneck_floor=2.0, bottleneck_beta=-1.0), "--bottleneck-beta"),
        (dict(bottleneck_beta=0.1), "--bottleneck-beta needs --bottleneck-floor"),
        (dict(bottleneck_floor=2.0, embedding_dp=1.0), "each replace the activ"),
        (
            dict(bottleneck_floor=2.0, forward_clip=1.0, forward_noise=0.1),
            "each replace the activations A sends: choose one",
        ),
        (dict(bottleneck_floor=2.0, named="none"), "--defence none and --bottleneck"),
    ],
)
def test_what_contradicts_a_bottleneck_is_refused_in_one_line(flags, match):
    with pytest.raises(ValueError, match=match) as e:
        dp.defence_from_flags(**flags)
    assert "\n" not in str(e.value)


def test_the_flags_put_it_in_place_of_the_forward_noise():
    spec = BottleneckSpec(4.0, 0.02)
    got = dp.defence_from_flags(bottleneck_floor=4.0, bottleneck_beta=0.02)
    assert got == dp.Recommended(bottleneck=spec)  # the gradient's noise stays
    assert not got.implied  # a defence flag: a resume must match it
    explicit = dp.defence_from_flags(
        bottleneck_floor=4.0, backward_clip=0.5, backward_noise=0.3
    )
    assert explicit == dp.CutDefence(
        backward=dp.Gaussian(0.5, 0.3), bottleneck=BottleneckSpec(4.0)
    )
    calibrated_ = dp.recommended_defence(1.0, 0.2, bottleneck=spec)
    assert calibrated_.forward is None and calibrated_.bottleneck == spec
    assert dp.Recommended(bottleneck=spec).matches(calibrated_)
    assert not dp.Recommended().matches(calibrated_)
    assert dp.CutDefence.from_dict(json.loads(json.dumps(explicit.to_dict()))) == (
        explicit
    )


def test_epsilon_is_the_gaussian_mechanism_at_the_floor():
    """Per row of T tokens of H coordinates: within R·√T, noise at least
    floor·R/√H per coordinate: the multiplier floor/√(T·H) of that bound."""
    spec = BottleneckSpec(64.0)
    defence = dp.CutDefence(bottleneck=spec)
    as_gaussian = dp.CutDefence(forward=dp.Gaussian(3.0, 64.0 / math.sqrt(256)))
    assert dp.epsilon(defence, 2, backward=False, coordinates=256) == pytest.approx(
        dp.epsilon(as_gaussian, 2, backward=False)
    )
    assert math.isinf(dp.epsilon(defence, 2, backward=False))  # no row size


# --- in split runs ------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory, news_data, split_config) -> Path:
    out = tmp_path_factory.mktemp("bottleneck_base") / "run"
    train(split_config, [news_data], out, train_cfg(steps=4, seed=5), progress=False)
    return out


@pytest.fixture(autouse=True)
def _fast_calibration(monkeypatch):
    monkeypatch.setattr(aisyn.split.defence.attach, "CALIBRATION_ROWS", 16)


SPEC = BottleneckSpec(2.0, 0.5)
TRAINED = dp.CutDefence(backward=dp.Gaussian(0.05, 0.3), bottleneck=SPEC)


def run(out, news_data, split_config, base, *, steps=4, defence=TRAINED, **kw):
    opts = kw.pop("opts", SplitOptions(cut=CUT, mode="local"))
    return split_train(
        split_config, [news_data], out, train_cfg(steps=steps, ckpt_every=2),
        opts, init_from=base, progress=False, defence=defence, **kw,
    )  # fmt: skip


def private(out: Path) -> dict[str, torch.Tensor]:
    last = ckpt.latest(out / "checkpoints")
    return ckpt.read_tensors(last / ckpt.PRIVATE_FILE)


@pytest.mark.heavy
def test_a_split_run_trains_it_and_keeps_it_at_a(
    tmp_path, news_data, split_config, base
):
    out = tmp_path / "run"
    summary = run(out, news_data, split_config, base)
    saved = private(out)
    assert set(saved) == {"bottleneck.rho", "bottleneck.centre", "bottleneck.radius"}
    # ρ learned (B's Jacobian and the capacity term reach it), centre and R set
    assert not torch.allclose(saved["bottleneck.rho"], torch.full((32,), -4.0))
    assert float(saved["bottleneck.radius"]) > 0
    assert float(saved["bottleneck.centre"].abs().sum()) > 0
    record = summary["privacy"]["bottleneck"]
    assert record["sigma_min"] >= SPEC.floor
    assert (
        0
        < record["capacity_bound_nats_per_token"]
        <= (record["capacity_at_floor_nats_per_token"])
    )
    assert json.loads((out / "privacy.json").read_text())["bottleneck"] == record
    # the model file is the model's alone (merge, export), and B's folder
    # holds nothing of the bottleneck, by name or by value
    model_file = ckpt.latest(out / "checkpoints") / ckpt.MODEL_FILE
    assert not any("bottleneck" in k for k in ckpt.read_tensors(model_file))
    for f in (out / COMPUTE_DIR).rglob("*.safetensors"):
        for name, t in ckpt.read_tensors(f).items():
            assert "bottleneck" not in name
            for mine in saved.values():
                assert t.shape != mine.shape or not torch.equal(t, mine), name


@pytest.mark.heavy
def test_it_learns_through_the_emulator_with_the_backbone_frozen(
    tmp_path, news_data, split_config, base
):
    out = tmp_path / "run"
    opts = SplitOptions(cut=CUT, mode="local", backbone="frozen")
    summary = run(out, news_data, split_config, base, opts=opts,
                  defence=dp.CutDefence(bottleneck=SPEC))  # fmt: skip
    # no gradient crosses: ε is the bottleneck's floor alone, finite
    assert summary["privacy"]["dp_epsilon"] is not None
    assert not torch.allclose(private(out)["bottleneck.rho"], torch.full((32,), -4.0))


@pytest.mark.heavy
def test_a_bottleneck_run_resumes_to_the_uninterrupted_losses(
    tmp_path, news_data, split_config, base
):
    run(tmp_path / "whole", news_data, split_config, base, steps=4)
    run(tmp_path / "cut", news_data, split_config, base, steps=2)
    split_train(
        split_config, [news_data], tmp_path / "cut", train_cfg(steps=4, ckpt_every=2),
        SplitOptions(cut=CUT, mode="local"), resume=True, progress=False,
        defence=TRAINED,
    )  # fmt: skip
    want, got = losses(tmp_path / "whole"), losses(tmp_path / "cut")
    assert len(got) == 4
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) < 1e-5
    torch.testing.assert_close(private(tmp_path / "cut"), private(tmp_path / "whole"))
    # another floor is another defence: refused, nothing overwritten
    before = (tmp_path / "cut" / "config.json").read_bytes()
    other = dp.CutDefence(
        backward=TRAINED.backward, bottleneck=BottleneckSpec(3.0, SPEC.beta)
    )
    with pytest.raises(ValueError, match="trained with cut defence") as e:
        split_train(
            split_config, [news_data], tmp_path / "cut",
            train_cfg(steps=6, ckpt_every=2), SplitOptions(cut=CUT, mode="local"),
            resume=True, progress=False, defence=other,
        )  # fmt: skip
    assert "\n" not in str(e.value)
    assert (tmp_path / "cut" / "config.json").read_bytes() == before


@pytest.mark.heavy
def test_evaluation_after_training_sends_through_the_trained_bottleneck(
    tmp_path, news_data, split_config, base
):
    from aisyn.split.client.evaluate import evaluate_split_run

    out = tmp_path / "run"
    run(out, news_data, split_config, base)
    result = evaluate_split_run(out, data_dir=news_data, device="cpu", max_items=4)
    assert result["test"]["samples"] > 0 and math.isfinite(result["test"]["loss"])


def test_the_command_line_puts_it_beside_the_default_gradient_noise(
    tmp_path, news_data, split_config, base
):
    from aisyn.cli import main

    model = tmp_path / "model.json"
    model.write_text(json.dumps(split_config.to_dict()))
    argv = ["split", "train", "--model", str(model), "--data", str(news_data)]
    argv += ["--out", str(tmp_path / "run"), "--cut", CUT, "--quiet", "--steps", "2"]
    argv += ["--batch-size", "4", "--micro-batch-size", "2", "--seed", "1234567"]
    argv += ["--init-from", str(base), "--bottleneck-floor", "2"]
    assert main(argv) in (0, None)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    used = dp.CutDefence.from_dict(config["cut_defence"])
    assert used.bottleneck == BottleneckSpec(2.0) and used.forward is None
    assert used.backward.noise == dp.RECOMMENDED.backward
    assert (ckpt.latest(tmp_path / "run" / "checkpoints") / ckpt.PRIVATE_FILE).is_file()


def test_a_data_party_over_ranks_refuses_it(tmp_path, news_data, split_config, base):
    class Ranks:  # what split_train asks of a data party's ranks first
        world = 2

        def problem_with(self, micro, method):
            return None

    with pytest.raises(ValueError, match="one process") as e:
        run(tmp_path / "run", news_data, split_config, base, ranks=Ranks())
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.heavy
@pytest.mark.parametrize("bad", ["nan", "huge"])
def test_a_compute_party_sending_nonsense_into_it_poisons_nothing(
    tmp_path, news_data, split_config, base, monkeypatch, bad
):
    """B's gradient of the cut reaches ρ: NaN, or one so large that A's
    squared norm overflows, skips the step on both sides with the usual one
    line; the bottleneck A saved stays finite and the step before is kept."""
    from test_hardening import Tamper, _nan

    from aisyn.split.backbone.compute_party import ComputeParty
    from aisyn.train.update import SkippedStep

    serve = ComputeParty.serve_session
    fn = _nan if bad == "nan" else (lambda t: t * 1e30)

    def malicious(self, link, session):
        return serve(self, Tamper(link, {("gact", 3): fn}), session)

    monkeypatch.setattr(ComputeParty, "serve_session", malicious)
    out = tmp_path / "run"
    reason = "values in the gradient of the cut" if bad == "nan" else "gradients on"
    with pytest.raises(SkippedStep, match=f"step 3: non-finite {reason}") as e:
        run(out, news_data, split_config, base)
    assert "\n" not in str(e.value)
    assert ckpt.latest(out / "checkpoints").name == "step_00000002"
    saved = private(out)
    assert ckpt.first_nonfinite(saved) is None
    assert float(saved["bottleneck.rho"].abs().max()) < 10  # Adam's steps: small

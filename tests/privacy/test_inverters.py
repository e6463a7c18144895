"""The trained attacks of ``inverters.py`` against a small real base: the
sequence inverter, its known-plaintext bound and similarity inference, and
what the audit reports where nothing crossed."""

from __future__ import annotations

import pytest
import torch

from aisyn.data.shards import TokenShards
from aisyn.model.segments import parse_partition
from aisyn.privacy.attacks import LearnedDecoder, frequent_token_rate, recovery
from aisyn.privacy.audit import Crossing, public_crossing
from aisyn.privacy.inverters import (
    InverterSettings,
    SequenceInverter,
    SimilarityInference,
    known_plaintext,
)

CUT = "u:1,0"  # one block before B: the activations are no longer embeddings
FIT = dict(steps=100, lr=3e-3, batch=16, seed=0)


@pytest.fixture(scope="module")
def material(base, news_data, reviews_data):
    """What the base sends at the cut for 64 public rows (B's training
    material), 64 rows of A's train split (the known plaintext) and 16 rows
    of A's test split (attacked), 8 rows a step."""
    from aisyn.train.models import load_run_model

    model, _ = load_run_model(base)
    model.eval().requires_grad_(False)
    cut = parse_partition(CUT, model.config)
    rows = torch.arange(64)
    public = TokenShards.open(reviews_data, "train").batch(rows)
    own = TokenShards.open(news_data, "train").batch(rows)
    attacked = TokenShards.open(news_data, "test").batch(torch.arange(16))
    return {
        "model": model,
        "public": public_crossing(model, public, cut, 8),
        "own": public_crossing(model, own, cut, 8),
        "attacked": public_crossing(model, attacked, cut, 8),
        "public_rows": public,
    }


def _inverter(c: Crossing, vocab: int = 8000) -> SequenceInverter:
    return SequenceInverter(
        c.acts.shape[-1], vocab, c.acts.shape[1], width=64, layers=1
    )


@pytest.mark.heavy
def test_the_sequence_inverter_reads_what_the_linear_decoder_reads_and_more(
    material,
):
    # Prepare
    public, seen = material["public"], material["attacked"]
    # Execute
    inverter = _inverter(public).fit(public.acts, public.inputs, **FIT)
    linear = LearnedDecoder(public.acts.shape[-1], 8000).fit(public.acts, public.inputs)
    # Assert: clearly past guessing, and no worse than the linear map
    got = recovery(inverter.predict(seen.acts), seen.inputs)
    guess = frequent_token_rate(seen.inputs)
    assert got > guess + 0.15, (got, guess)
    assert got >= recovery(linear.predict(seen.acts), seen.inputs)


def test_the_sequence_inverter_reads_labels_from_gradients(material):
    """On gradients (each position's scaled to unit length: their scale is
    A's loss normalisation) it names the labels."""
    public, seen = material["public"], material["attacked"]
    inverter = SequenceInverter(
        public.grad.shape[-1],
        8000,
        public.grad.shape[1],
        width=64,
        layers=1,
        normalise=True,
    ).fit(public.grad, public.labels, **FIT)
    got = recovery(inverter.predict(seen.grad), seen.labels)
    assert got > frequent_token_rate(seen.labels) + 0.15, got


def test_the_sequence_inverter_is_deterministic_under_its_seed(material):
    public = material["public"]
    fit = dict(FIT, steps=5)
    a = _inverter(public).fit(public.acts, public.inputs, **fit)
    b = _inverter(public).fit(public.acts, public.inputs, **fit)
    torch.manual_seed(123)  # the global generator plays no part
    c = _inverter(public).fit(public.acts, public.inputs, **fit)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
        assert torch.equal(value, c.state_dict()[key]), key


def test_under_noise_far_above_the_signal_the_inverter_falls_to_guessing(material):
    """B fits on public text through the same mechanism (Gaussian noise of
    50 clipping bounds per row), as the frontier does, and gets no more than
    the frequent token."""
    from dataclasses import replace

    from aisyn.privacy.frontier import mechanism
    from aisyn.split.defence import cut_dp as dp
    from aisyn.split.defence.calibration import calibrate

    # Prepare: the clip calibrated on the public rows, as for a real run
    clip = calibrate(material["model"], material["public_rows"], CUT, 8).forward
    forward, backward = mechanism(dp.CutDefence(forward=dp.Gaussian(clip, 50.0)))
    assert backward is None  # the gradient crosses in the clear
    public = replace(material["public"], acts=forward(material["public"].acts))
    seen = replace(material["attacked"], acts=forward(material["attacked"].acts))
    # two draws of the mechanism are two draws of noise
    acts = material["attacked"].acts
    assert not torch.equal(forward(acts), forward(acts))
    # Execute
    inverter = _inverter(public).fit(public.acts, public.inputs, **FIT)
    # Assert
    got = recovery(inverter.predict(seen.acts), seen.inputs)
    assert got <= frequent_token_rate(seen.inputs) + 0.03, got


@pytest.mark.heavy
def test_known_plaintext_reads_at_least_what_public_text_alone_reads(material):
    public, own, seen = material["public"], material["own"], material["attacked"]
    inverter = _inverter(public).fit(public.acts, public.inputs, **FIT)
    before = {k: v.clone() for k, v in inverter.state_dict().items()}
    tuned = known_plaintext(inverter, own.acts, own.inputs, steps=50, lr=3e-3, batch=16)
    public_only = recovery(inverter.predict(seen.acts), seen.inputs)
    bound = recovery(tuned.predict(seen.acts), seen.inputs)
    assert bound >= public_only, (bound, public_only)
    # the public-only attacker is left as it was (a copy is fine-tuned)
    assert all(torch.equal(v, inverter.state_dict()[k]) for k, v in before.items())


def test_similarity_reads_labels_from_gradients_and_inputs_from_activations(
    material,
):
    public, seen = material["public"], material["attacked"]
    labels = SimilarityInference(8000, normalise=True).fit(public.grad, public.labels)
    inputs = SimilarityInference(8000).fit(public.acts, public.inputs)
    got_labels = recovery(labels.predict(seen.grad), seen.labels)
    got_inputs = recovery(inputs.predict(seen.acts), seen.inputs)
    assert got_labels > frequent_token_rate(seen.labels) + 0.2, got_labels
    assert got_inputs > frequent_token_rate(seen.inputs) + 0.2, got_inputs
    # only tokens seen in public text are ever guessed
    assert labels.seen[labels.predict(seen.grad)].all()


@pytest.mark.heavy
def test_nothing_crossed_backward_is_reported_as_such(
    base, news_data, reviews_data, tiny_inverter
):
    """A mode where no gradient crosses (``--backbone frozen``): every
    backward attack that reads the gradient reports None by "nothing
    crossed"; the base head, which reads B's own output, still measures what
    B knows of the labels; the forward attacks measure as before."""
    from aisyn.privacy.frontier import Point, attack_point
    from aisyn.privacy.yardstick import worst
    from aisyn.split.defence import cut_dp as dp
    from aisyn.train.models import load_run_model

    model, _ = load_run_model(base)
    model.eval().requires_grad_(False)
    public = TokenShards.open(reviews_data, "train").batch(torch.arange(16))
    rows = TokenShards.open(news_data, "test").batch(torch.arange(2))
    known = TokenShards.open(news_data, "train").batch(torch.arange(8))
    # Execute
    got = attack_point(
        Point("none", cut=CUT),
        dp.CutDefence(),
        {"base (early)": model},
        model,
        rows,
        public,
        2,
        inverter=tiny_inverter,
        known_rows=known,
        gradient_crosses=False,
    )
    # Assert
    back = next(r for r in got if r["direction"] == "backward")
    assert back["best_attack"] == "base head"
    per_attack = {k: v for k, v in back.items() if k.startswith("recovery_")}
    assert set(per_attack) == {
        "recovery_white-box",
        "recovery_base head",
        "recovery_learned",
        "recovery_similarity",
    }
    gradient_read = {k: v for k, v in per_attack.items() if k != "recovery_base head"}
    assert all(v is None for v in gradient_read.values())
    assert back["recovery"] == per_attack["recovery_base head"] is not None
    front = next(r for r in got if r["direction"] == "forward")
    assert front["recovery"] is not None and front["best_attack"] != "nothing crossed"
    assert {"recovery_sequence inverter", "recovery_known plaintext"} <= set(front)
    best, _ = worst(got, trained=False)
    assert best is not None and best <= front["recovery"]


def test_bad_inverter_settings_are_one_line():
    with pytest.raises(ValueError, match="^inverter width 30 must be a multiple"):
        InverterSettings(width=30, heads=4)
    with pytest.raises(ValueError, match="^inverter steps must be >= 1, got 0$"):
        InverterSettings(steps=0)
    inverter = SequenceInverter(8, 10, 4, width=8, layers=1, heads=2)
    with pytest.raises(ValueError, match="^this inverter is not fitted yet"):
        inverter.predict(torch.zeros(1, 4, 8))
    with pytest.raises(ValueError, match=r"^features must be \(B, T, 8\)"):
        inverter.fit(torch.zeros(2, 4, 7), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="^token 10 is outside the vocabulary of 10$"):
        inverter.fit(torch.zeros(2, 4, 8), torch.full((2, 4), 10))
    inverter.fit(torch.zeros(2, 4, 8), torch.zeros(2, 4, dtype=torch.long), steps=1)
    with pytest.raises(
        ValueError, match="^5 positions: this inverter reads at most 4$"
    ):
        inverter.predict(torch.zeros(1, 5, 8))


@pytest.mark.heavy
def test_the_audit_reports_nothing_crossed_where_no_gradient_does(
    tmp_path, base, news_data, reviews_data, tiny_inverter, monkeypatch
):
    """The audit's own report (table, csv and plot) where A returns no
    gradient: every backward row that reads the gradient says "nothing
    crossed", none crashes; the base head on B's own output still reads."""
    import aisyn.privacy.audit as audit_module
    from aisyn.privacy.audit import AuditSettings, audit

    real = audit_module.crossing

    def no_gradient(model, rows, partition, send=None):
        c = real(model, rows, partition, send)
        return Crossing(c.inputs, c.labels, c.acts, c.out, None)

    monkeypatch.setattr(audit_module, "crossing", no_gradient)
    report = audit(
        base,
        news_data,
        reviews_data,
        tmp_path / "out",
        [CUT],
        settings=AuditSettings(
            samples=2, public_samples=8, steps=2, inverter=tiny_inverter
        ),
    )
    back = [r for r in report["rows"] if r["direction"] == "backward"]
    # white-box x B's knowledge, learned, similarity; and the base head
    assert len(back) == 5
    assert all((r["recovery"] is None) == (r["attack"] != "base head") for r in back)
    front = [r for r in report["rows"] if r["direction"] == "forward"]
    assert all(r["recovery"] is not None for r in front)
    table = (tmp_path / "out" / "audit.md").read_text()
    assert table.count("| backward | nothing crossed |") == 4
    assert (tmp_path / "out" / "recovery.png").is_file()

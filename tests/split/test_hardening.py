"""What the compute party B learns, and what a faulty or malicious peer can do
to the update step: each test reproduces a finding of the attacker-minded trial
(issue 8) and failed before its fix."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import CUT, train_cfg

from aisyn.link.errors import LinkError, PeerAbortedError, SessionAbortedError
from aisyn.link.memory import IN_PROCESS, memory_pair
from aisyn.model.causal_lm import parameter_seed
from aisyn.model.families import build_model
from aisyn.model.pangu import PanguConfig
from aisyn.model.segments import (
    COMPUTE_PARTY,
    DATA_PARTY,
    build_party_model,
    init_seeds,
    own_state_dict,
    parse_partition,
)
from aisyn.split import protocol as proto
from aisyn.split.backbone.compute_party import ComputeParty
from aisyn.split.client.train import secret_seed, split_train
from aisyn.split.party import PartyState, SkippedStep
from aisyn.split.session import SplitOptions
from aisyn.train import checkpoint as ckpt
from aisyn.train.run import read_metrics

# --- what B learns ---------------------------------------------------------------


def _integers(obj) -> set[int]:
    """Every integer anywhere in a JSON value (the attacker's seed candidates)."""
    if isinstance(obj, bool):
        return set()
    if isinstance(obj, int):
        return {obj}
    if isinstance(obj, dict):
        return set().union(*(_integers(v) for v in obj.values()), set())
    if isinstance(obj, list):
        return set().union(*(_integers(v) for v in obj), set())
    return set()


@pytest.fixture
def spied_hellos(monkeypatch) -> list[str]:
    """Every hello text the compute party receives."""
    seen: list[str] = []
    negotiate = ComputeParty.negotiate

    def spy(self, text: str, identity: str):
        seen.append(text)
        return negotiate(self, text, identity)

    monkeypatch.setattr(ComputeParty, "negotiate", spy)
    return seen


@pytest.mark.heavy
def test_compute_party_cannot_rebuild_the_data_partys_initial_weights(
    tmp_path, news_data, split_config, spied_hellos
):
    """Before: the hello carried A's whole TrainConfig, seed included, and init
    was a public function of (seed, name), so B rebuilt A's embedding and front
    blocks and inverted every activation it received."""
    # Prepare: a run with the seed a user gets by default (none given)
    out = tmp_path / "run"
    cfg = train_cfg(steps=1, seed=secret_seed(out, resume=False))
    # Execute
    split_train(
        split_config, [news_data], out, cfg, SplitOptions(cut=CUT), progress=False
    )
    # Assert: B was told only what it needs ...
    (text,) = spied_hellos
    hello = json.loads(text)
    assert set(hello["train"]) == set(proto.COMPUTE_PARTY_TRAIN_FIELDS)
    assert str(cfg.seed) not in text
    part = parse_partition(CUT, split_config)
    assert set(hello["init_seeds"]) == set(
        part.parameter_names(build_model(split_config, device="meta"), COMPUTE_PARTY)
    )
    # ... and playing B with all of it does not reproduce A's initial tensors:
    # every integer it received, and the usual small seeds, tried as the run's
    # seed; every parameter seed it received, tried on A's embedding.
    a_init = own_state_dict(
        build_party_model(split_config, part, DATA_PARTY, seed=cfg.seed),
        part,
        DATA_PARTY,
    )
    wte = a_init["transformer.wte.weight"]
    for guess in _integers(hello) | set(range(64)) | {1234, 42}:
        guessed = build_party_model(split_config, part, DATA_PARTY, seed=guess)
        for name, t in own_state_dict(guessed, part, DATA_PARTY).items():
            if name.endswith("weight") and ".ln_" not in name and "ln_f" not in name:
                assert not torch.equal(t, a_init[name]), (guess, name)
    meta = build_model(split_config, device="meta")
    for given in hello["init_seeds"].values():
        g = torch.Generator().manual_seed(given)
        attempt = torch.empty_like(wte).normal_(0.0, split_config.init_std, generator=g)
        assert not torch.equal(attempt, wte)
    assert "transformer.wte.weight" in part.parameter_names(meta, DATA_PARTY)


def test_compute_party_seeds_give_the_unsplit_models_weights(split_config):
    """The keyed per-parameter seeds keep split training exact: B's tensors
    built from the seeds it is given equal the whole model's."""
    part = parse_partition(CUT, split_config)
    whole = build_model(split_config, seed=987654321123)
    seeds = init_seeds(split_config, part, COMPUTE_PARTY, 987654321123)
    b = build_party_model(split_config, part, COMPUTE_PARTY, seeds=seeds)
    for name, t in own_state_dict(b, part, COMPUTE_PARTY).items():
        assert torch.equal(t, whole.state_dict()[name]), name
    assert seeds[name] == parameter_seed(987654321123, name)


def test_hello_with_fields_b_does_not_need_is_refused(tmp_path, split_config):
    """A strict list, so a future change cannot start leaking by accident."""
    part = parse_partition(CUT, split_config)
    party = ComputeParty(split_config, part, tmp_path / "b")
    hello = proto.hello(
        purpose="train",
        run_id="r1",
        model=split_config.to_dict(),
        partition=part.to_dict(),
        train=train_cfg(),
        init_seeds=init_seeds(split_config, part, COMPUTE_PARTY, 5),
    )
    hello["train"]["seed"] = 11
    with pytest.raises(LinkError, match=r"unexpected \['seed'\]"):
        party.negotiate(proto.encode_json(hello), IN_PROCESS)
    del hello["train"]["seed"]
    hello["init_seeds"] = None
    with pytest.raises(LinkError, match="needs the init seeds"):
        party.negotiate(proto.encode_json(hello), IN_PROCESS)
    assert not (tmp_path / "b").exists()


def test_split_run_seed_is_secret_unless_given_and_kept_on_resume(tmp_path):
    out = tmp_path / "run"
    a, b = secret_seed(out, resume=False), secret_seed(out, resume=False)
    assert a != b and a >= 0 and b < 2**63
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"train": {"seed": 77}}))
    assert secret_seed(out, resume=True) == 77


# --- a malicious or faulty peer and the update step ------------------------------


class Tamper:
    """Wraps a link; replaces what this side sends under chosen (tag, round)."""

    def __init__(self, link, tensors=None, scalars=None) -> None:
        self._link = link
        self.tensors = tensors or {}  # (tag, round) -> function of the tensor
        self.scalars = scalars or {}  # (tag, round) -> value

    def send(self, tag, tensor, *, step, micro=0, codec=None):
        fn = self.tensors.get((tag, step))
        if fn is not None:
            tensor = fn(tensor.detach().clone())
        self._link.send(tag, tensor, step=step, micro=micro, codec=codec)

    def send_scalar(self, tag, value, *, step):
        value = self.scalars.get((tag, step), value)
        self._link.send_scalar(tag, value, step=step)

    def __getattr__(self, name):
        return getattr(self._link, name)


def _nan(t: torch.Tensor) -> torch.Tensor:
    t.view(-1)[::7] = math.nan
    return t


def _inf(t: torch.Tensor) -> torch.Tensor:
    t.view(-1)[0] = math.inf
    return t


# Rounds of a run with ckpt_every=2: 0 train, 1 train, 2 save, 3 train (step 3)
@pytest.mark.parametrize(
    ("tensors", "scalars", "reason"),
    [
        ({("gact", 3): _nan}, {}, "non-finite values in the gradient of the cut"),
        ({("out", 3): _inf}, {}, "non-finite values in the backbone output"),
        ({}, {("sqnorm", 3): math.nan}, "compute party found non-finite values"),
        ({}, {("sqnorm", 3): -1e9}, "squared gradient norm of -1000000000.0"),
        ({}, {("sqnorm", 3): -1e-3}, "squared gradient norm of -0.001"),
        ({}, {("sqnorm", 3): math.inf}, "squared gradient norm of inf"),
    ],
    ids=[
        "gact_nan",
        "out_inf",
        "sqnorm_nan",
        "sqnorm_-1e9",
        "sqnorm_-1e-3",
        "sqnorm_inf",
    ],
)
def test_bad_values_from_the_compute_party_skip_the_step_on_both_sides(
    tmp_path, news_data, split_config, monkeypatch, tensors, scalars, reason
):
    """Before: A applied the step and wrote a checkpoint of 53 all-NaN tensors
    (NaN gact or sqnorm); -1e9 ended in "math domain error", -1e-3 silently
    disabled clipping and +inf silently zeroed A's step."""
    serve = ComputeParty.serve_session

    def malicious(self, link, session):
        return serve(self, Tamper(link, tensors, scalars), session)

    monkeypatch.setattr(ComputeParty, "serve_session", malicious)
    out = tmp_path / "run"
    # Execute
    with pytest.raises(SkippedStep) as info:
        split_train(
            split_config,
            [news_data],
            out,
            train_cfg(steps=4, ckpt_every=2),
            SplitOptions(cut=CUT),
            progress=False,
        )
    # Assert: one line naming the step and the culprit
    message = str(info.value)
    assert "step 3:" in message and reason in message and "\n" not in message
    # Nothing non-finite reached a checkpoint of either party; step 2 is kept.
    (b_run,) = (out / "compute").iterdir()
    for party_dir in (out, b_run):
        steps = sorted(p.name for p in (party_dir / "checkpoints").glob("step_*"))
        assert steps == ["step_00000002"]
        for name in (ckpt.MODEL_FILE, ckpt.OPTIM_FILE):
            tensors_ = ckpt.read_tensors(party_dir / "checkpoints" / steps[0] / name)
            assert ckpt.first_nonfinite(tensors_) is None
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]


def _drive_b(split_config: PanguConfig, tmp_path: Path, act_fn, sqnorm: float):
    """Play a malicious data party against a real compute party: one TRAIN
    round with tampered activations and a chosen sqnorm, then SAVE."""
    part = parse_partition(CUT, split_config)
    party = ComputeParty(split_config, part, tmp_path / "b")
    cfg = train_cfg()
    hello = proto.hello(
        purpose="train",
        run_id="evil",
        model=split_config.to_dict(),
        partition=part.to_dict(),
        train=cfg,
        init_seeds=init_seeds(split_config, part, COMPUTE_PARTY, 3),
    )
    _, session = party.negotiate(proto.encode_json(hello), IN_PROCESS)
    link_a, link_b = memory_pair("none")
    import threading

    thread = threading.Thread(
        target=lambda: party.serve_session(link_b, session), daemon=True
    )
    thread.start()
    mb, T, C = 2, 16, split_config.hidden_size
    link_a.send("ctl", proto.Control(proto.TRAIN, 0, 1, mb, T, 0, 0).tensor(), step=0)
    link_a.send("act", act_fn(torch.randn(mb, T, C)), step=0)
    link_a.recv("out", step=0, shape=(mb, T, C), dtype=torch.float32)
    link_a.send("gout", torch.randn(mb, T, C), step=0)
    link_a.recv("gact", step=0, shape=(mb, T, C), dtype=torch.float32)
    link_a.send_scalar("sqnorm", sqnorm, step=0)
    theirs = link_a.recv_scalar("sqnorm", step=0)
    link_a.send("ctl", proto.Control(proto.SAVE, 0).tensor(), step=1)
    saved = link_a.recv_scalar("saved", step=1)
    link_a.close()
    thread.join(10)
    link_b.close()  # as open_local does: its send thread would outlive the test
    return theirs, saved, tmp_path / "b" / "evil" / "checkpoints"


def test_nan_activations_with_a_finite_scalar_do_not_poison_bs_checkpoint(
    tmp_path, split_config
):
    """Before: NaN activations + a finite scalar + SAVE wrote a NaN checkpoint
    at B. Now B reports NaN (it skips), stays at step 0 and saves finite
    weights: its initial ones."""
    theirs, saved, root = _drive_b(split_config, tmp_path, _nan, 1.0)
    assert math.isnan(theirs)  # B tells A it skips
    assert saved == 0.0  # B is still at step 0
    weights = ckpt.read_tensors(root / "step_00000000" / ckpt.MODEL_FILE)
    assert ckpt.first_nonfinite(weights) is None
    part = parse_partition(CUT, split_config)
    init = build_party_model(
        split_config,
        part,
        COMPUTE_PARTY,
        seeds=init_seeds(split_config, part, COMPUTE_PARTY, 3),
    )
    for name, t in own_state_dict(init, part, COMPUTE_PARTY).items():
        assert torch.equal(weights[name], t), name


@pytest.mark.parametrize("sqnorm", [-1e-3, math.inf, math.nan])
def test_compute_party_skips_on_a_bad_scalar_from_the_data_party(
    tmp_path, split_config, sqnorm
):
    _, saved, root = _drive_b(split_config, tmp_path, lambda t: t, sqnorm)
    assert saved == 0.0  # the step was not applied
    weights = ckpt.read_tensors(root / "step_00000000" / ckpt.MODEL_FILE)
    assert ckpt.first_nonfinite(weights) is None


def test_checkpoint_with_a_non_finite_tensor_is_never_written(tmp_path):
    root = tmp_path / "checkpoints"
    good = {ckpt.MODEL_FILE: {"w": torch.ones(3)}}
    ckpt.save(root, 1, good, {"x": 1})
    before = sorted(p.name for p in root.iterdir())
    bad = {ckpt.MODEL_FILE: {"w": torch.tensor([1.0, math.nan, 2.0])}}
    with pytest.raises(ckpt.CheckpointError, match="w in model.safetensors holds"):
        ckpt.save(root, 2, bad, {"x": 2})
    with pytest.raises(ckpt.CheckpointError, match="non-finite"):
        ckpt.save(root, 1, bad, {"x": 2})  # nor over an existing good one
    assert sorted(p.name for p in root.iterdir()) == before
    assert torch.equal(
        ckpt.read_tensors(root / "step_00000001" / "model.safetensors")["w"],
        torch.ones(3),
    )


def test_fp16_codec_overflow_is_reported_as_such():
    """Before: values beyond 65504 silently became inf on the wire."""
    a, b = memory_pair("fp16")
    try:
        a.send("act", torch.tensor([1.0, 7e4, 2.0]), step=0)
        with pytest.raises(SessionAbortedError, match="fp16 codec overflow"):
            a.flush(5)
        with pytest.raises(PeerAbortedError, match="fp16 codec overflow"):
            b.recv("act", step=0, timeout=5)
    finally:
        a.close()
        b.close()


def test_a_sum_of_squared_norms_that_overflows_skips_the_step(split_config):
    part = parse_partition(CUT, split_config)
    state = PartyState(split_config, part, DATA_PARTY, train_cfg(), torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in state.named}
    for p in state.params:
        p.grad = torch.ones_like(p)
    with pytest.raises(SkippedStep, match="step 8: the global squared gradient"):
        state.apply_step(7, 1.7e308, 1.7e308)
    assert all(p.grad is None for p in state.params)
    for n, p in state.named:
        assert torch.equal(p, before[n]), n


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_accepted_resume_hello_changes_nothing_on_bs_disk(
    tmp_path, news_data, split_config
):
    """Before: an accepted resume hello rewrote B's config.json with A's
    settings (e.g. "device": "cuda:9"), even if the session then failed."""
    out = tmp_path / "run"
    split_train(
        split_config,
        [news_data],
        out,
        train_cfg(steps=2),
        SplitOptions(cut=CUT),
        progress=False,
    )
    config = json.loads((out / "config.json").read_text())
    b_root = out / "compute"
    before = _snapshot(b_root)
    b_config = json.loads((b_root / config["run_id"] / "config.json").read_text())
    assert set(b_config["train"]) == set(proto.COMPUTE_PARTY_TRAIN_FIELDS)
    part = parse_partition(CUT, split_config)
    party = ComputeParty(split_config, part, b_root)
    hello = proto.hello(
        purpose="train",
        run_id=config["run_id"],
        model=split_config.to_dict(),
        partition=part.to_dict(),
        train=train_cfg(steps=2, lr=0.5, device="cuda:9"),
        resume=True,
        a_steps=[2],
    )
    # Execute
    reply, session = party.negotiate(proto.encode_json(hello), IN_PROCESS)
    # Assert
    assert json.loads(reply)["start_step"] == 2 and session.train.lr == 0.5
    assert _snapshot(b_root) == before

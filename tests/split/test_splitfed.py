"""SplitFed: data parties sharing one backbone at B, their segments averaged
by a Flower strategy (``aisyn.splitfed``)."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from aisyn.fl.settings import FLSettings
from aisyn.splitfed.run import run_splitfed
from aisyn.train import checkpoint as ckpt
from aisyn.train.finetune import finetune
from aisyn.train.lora import Method
from aisyn.train.models import load_run_model
from aisyn.train.run import read_metrics

LOCAL = dict(batch_size=4, micro_batch_size=2, lr=2e-3, warmup=1, seed=11)


def settings(parties: int, **kw) -> FLSettings:
    d = dict(
        rounds=2,
        local_steps=3,
        min_clients=parties,
        eval_items=8,
        device="cpu",
        **LOCAL,
    )
    d.update(kw)
    return FLSettings.from_dict(d)


def step_losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def other_sft(tmp_path_factory, tokenizer) -> Path:
    """A second domain: cloze items of product reviews (the base's tokenizer)."""
    from aisyn.data.corpora import load_corpus
    from aisyn.data.sft import prepare_sft

    root = tmp_path_factory.mktemp("reviews_sft")
    docs = [d.text.replace("\n", " ") for d in load_corpus("reviews").documents[:300]]
    corpus = root / "reviews.txt"
    corpus.write_text(
        "".join(d[: 12 + (i * 7) % 40] + "\n" for i, d in enumerate(docs)),
        encoding="utf-8",
    )
    out = root / "sft"
    prepare_sft(load_corpus(corpus), tokenizer, 64, out, per_document=2)
    return out


@pytest.fixture(scope="module")
def two_parties(tmp_path_factory, ft_base, ft_sft_dir, other_sft) -> dict:
    out = tmp_path_factory.mktemp("splitfed") / "run"
    s = settings(2)
    summary = run_splitfed(
        ft_base, {"news": ft_sft_dir, "reviews": other_sft}, out, s, log_every=1
    )
    return {"out": out, "summary": summary, "settings": s}


@pytest.mark.heavy
def test_one_party_equals_fine_tuning_the_whole_model(tmp_path, ft_base, ft_sft_dir):
    """With one party the average is the party's own segments and the shared
    backbone is its backbone: SplitFed is split fine-tuning, which is the
    unsplit fine-tuning step for step (1e-5)."""
    s = settings(1)
    run_splitfed(ft_base, {"news": ft_sft_dir}, tmp_path / "sf", s, log_every=1)
    split = step_losses(tmp_path / "sf" / "parties" / "news")
    cfg = replace(s.train, log_every=1)  # the parties' own settings
    finetune(ft_base, [ft_sft_dir], tmp_path / "ft", cfg, Method(), progress=False)
    whole = step_losses(tmp_path / "ft")
    assert len(split) == len(whole) == s.total_local_steps
    for a, b in zip(split, whole, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    # and the merged model is the fine-tuned one
    merged, _ = load_run_model(tmp_path / "sf" / "merged")
    tuned, _ = load_run_model(tmp_path / "ft")
    for (n, p), (m, q) in zip(
        merged.state_dict().items(), tuned.state_dict().items(), strict=True
    ):
        assert n == m
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@pytest.mark.heavy
def test_the_backbone_takes_every_partys_steps(two_parties):
    s, summary, out = (
        two_parties["settings"],
        two_parties["summary"],
        two_parties["out"],
    )
    assert summary["backbone_steps"] == 2 * s.total_local_steps
    b_steps = ckpt.complete_steps(Path(summary["backbone"]) / "checkpoints")
    assert b_steps[-1] == 2 * s.total_local_steps
    for name in ("news", "reviews"):
        assert len(step_losses(out / "parties" / name)) == s.total_local_steps
    rounds = [r for r in read_metrics(out / "metrics.jsonl") if "link_bytes" in r]
    assert [r["round"] for r in rounds] == [1, 2]
    assert [r["step"] for r in rounds] == [6, 12]
    assert all(r["link_bytes"] > 0 and r["accepted"] == 2 for r in rounds)
    assert math.isfinite(summary["final_global_valid_loss"])


def test_the_global_segments_are_the_parties_weighted_mean(two_parties):
    """After the last round the global segments are FedAvg's mean of the two
    parties' segments, weighted by their item counts."""
    out = two_parties["out"]
    summary = two_parties["summary"]
    from aisyn.data.sft import SFTData

    counts = {
        n: len(SFTData.open(Path(p), "train"))
        for n, p in json.loads((out / "config.json").read_text())["parties"].items()
    }
    step = summary["backbone_steps"]
    glob = ckpt.read_tensors(
        ckpt.step_folder(out / "global" / "checkpoints", step) / ckpt.MODEL_FILE
    )
    local = {
        n: ckpt.read_tensors(
            ckpt.step_folder(out / "parties" / n / "checkpoints", 6) / ckpt.MODEL_FILE
        )
        for n in counts
    }
    total = sum(counts.values())
    trained = [
        k
        for k in local["news"]
        if not torch.equal(local["news"][k], local["reviews"][k])
    ]
    assert trained  # the parties did train apart
    for k in trained:
        mean = sum(local[n][k].double() * counts[n] for n in counts) / total
        torch.testing.assert_close(glob[k], mean.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.heavy
def test_a_run_is_the_same_every_time(
    tmp_path, two_parties, ft_base, ft_sft_dir, other_sft
):
    out = tmp_path / "again"
    run_splitfed(
        ft_base,
        {"news": ft_sft_dir, "reviews": other_sft},
        out,
        two_parties["settings"],
        log_every=1,
    )
    for name in ("news", "reviews"):
        assert step_losses(out / "parties" / name) == step_losses(
            two_parties["out"] / "parties" / name
        )


@pytest.mark.heavy
def test_lora_parties_train_adapters_on_one_backbone(tmp_path, ft_base, ft_sft_dir):
    """LoRA everywhere: one party's run is LoRA fine-tuning of the whole
    model, step for step; B's checkpoints hold its adapters alone."""
    s = settings(1, method="lora", lora_rank=4)
    summary = run_splitfed(
        ft_base, {"news": ft_sft_dir}, tmp_path / "sf", s, log_every=1
    )
    cfg = replace(s.train, log_every=1)
    finetune(
        ft_base, [ft_sft_dir], tmp_path / "ft", cfg, s.method_spec(), progress=False
    )
    split, whole = (
        step_losses(tmp_path / "sf" / "parties" / "news"),
        step_losses(tmp_path / "ft"),
    )
    assert len(split) == len(whole) == s.total_local_steps
    for a, b in zip(split, whole, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    folder = ckpt.step_folder(
        Path(summary["backbone"]) / "checkpoints", summary["backbone_steps"]
    )
    names = ckpt.read_tensors(folder / ckpt.MODEL_FILE)
    assert names and all(".lora_" in n for n in names)


@pytest.mark.heavy
def test_fedprox_pulls_each_party_toward_the_global_segments(
    tmp_path, ft_base, ft_sft_dir, other_sft
):
    """FedProx's term reaches the parties' steps: with a large mu every
    party ends its round nearer the round's global segments than FedAvg's."""

    def drift(strategy: str) -> float:
        out = tmp_path / strategy
        s = settings(2, rounds=1, strategy=strategy, proximal_mu=50.0)
        run_splitfed(ft_base, {"news": ft_sft_dir, "reviews": other_sft}, out, s)
        start = ckpt.read_tensors(ckpt.model_file(ft_base))
        total = 0.0
        for name in ("news", "reviews"):
            folder = ckpt.step_folder(out / "parties" / name / "checkpoints", 3)
            local = ckpt.read_tensors(folder / ckpt.MODEL_FILE)
            total += sum(
                float((local[k] - start[k]).pow(2).sum()) for k in local if k in start
            )
        return total

    assert drift("fedprox") < 0.8 * drift("fedavg")


@pytest.mark.heavy
def test_a_party_sending_misshapen_segments_is_left_out(
    tmp_path, ft_base, ft_sft_dir, other_sft, monkeypatch, caplog
):
    """A party (valid, but lying) whose segments do not have the others'
    shapes is rejected by the strategy's guard, in one line naming the
    tensor; the round averages the others."""
    from aisyn.splitfed import member as member_mod

    honest = member_mod.Member.segments

    def segments(self):
        tensors = honest(self)
        if self.name == "reviews":
            name = next(iter(tensors))
            tensors = {**tensors, name: tensors[name][:1]}
        return tensors

    monkeypatch.setattr(member_mod.Member, "segments", segments)
    out = tmp_path / "run"
    s = settings(2, rounds=1)
    with caplog.at_level("WARNING", logger="aisyn.fl"):
        summary = run_splitfed(
            ft_base, {"news": ft_sft_dir, "reviews": other_sft}, out, s
        )
    [line] = [
        r.getMessage() for r in caplog.records if "rejected update" in r.getMessage()
    ]
    assert "expected float32" in line
    step = summary["backbone_steps"]
    glob = ckpt.read_tensors(
        ckpt.step_folder(out / "global" / "checkpoints", step) / ckpt.MODEL_FILE
    )
    news = ckpt.read_tensors(
        ckpt.step_folder(out / "parties" / "news" / "checkpoints", 3) / ckpt.MODEL_FILE
    )
    for k, v in news.items():
        torch.testing.assert_close(glob[k], v)  # the honest party's alone


@pytest.mark.parametrize(
    ("parties", "kw", "message"),
    [
        ({"news": "NEWS", "news2": "FOREIGN"}, {}, "party news2: .*tokenizer"),
        ({"news": "NEWS", "../x": "NEWS"}, {}, "party name '../x'"),
        (
            {"news": "NEWS", "b": "NEWS"},
            {"secure_aggregation": True},
            "secure aggregation",
        ),
        ({"news": "NEWS"}, {}, "min-clients is 2 but 1 parties"),
        ({"news": "NEWS", "b": "MISSING"}, {}, "party b: .*not found"),
    ],
)
def test_bad_consortia_are_refused_before_anything_is_written(
    tmp_path, ft_base, ft_sft_dir, parties, kw, message
):
    foreign = tmp_path / "foreign"
    shutil.copytree(ft_sft_dir, foreign)
    m = json.loads((foreign / "manifest.json").read_text())
    m["tokenizer"]["sha256"] = "0" * 64
    (foreign / "manifest.json").write_text(json.dumps(m))
    paths = {"NEWS": ft_sft_dir, "FOREIGN": foreign, "MISSING": tmp_path / "none"}
    out = tmp_path / "run"
    s = settings(2, **kw)
    with pytest.raises(ValueError, match=message):
        run_splitfed(ft_base, {n: paths[d] for n, d in parties.items()}, out, s)
    assert not out.exists()


def lying_party(monkeypatch, node: int, tag: str, scale: float | None) -> None:
    """Make the ``node``-th party's link lie about every ``tag`` tensor it
    sends (``act``: its activations, ``gout``: its gradients of the
    backbone's output): NaN where ``scale`` is None, else scaled by it. The
    party's credentials and everything else are as an honest one's."""
    from aisyn.splitfed import run as run_mod

    real = run_mod.memory_pair
    made = []

    def pair(*args, **kw):
        link_a, link_b = real(*args, **kw)
        made.append(link_a)
        if len(made) == node:
            send = link_a.send

            def lie(t, tensor, **k):
                if t == tag:
                    tensor = (
                        torch.full_like(tensor, math.nan)
                        if scale is None
                        else tensor * scale
                    )
                return send(t, tensor, **k)

            link_a.send = lie
        return link_a, link_b

    monkeypatch.setattr(run_mod, "memory_pair", pair)


@pytest.mark.parametrize(
    ("liar", "tag", "scale", "why"),
    [
        pytest.param("reviews", "gout", None, "non-finite values", id="nan"),
        pytest.param(
            "reviews",
            "act",
            1e6,
            "RMS of its activations",
            id="x1e6-activations",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "reviews",
            "gout",
            1e6,
            "RMS of its output gradients",
            id="x1e6-gradients",
            marks=pytest.mark.slow,
        ),
        # the first party to step has nothing to be compared with in round 1:
        # caught in round 2, and its tiny gradients do not drop the honest one
        pytest.param(
            "news", "act", 1e6, "RMS of its activations", id="x1e6-first-party"
        ),
    ],
)
@pytest.mark.heavy
def test_a_lying_party_is_dropped_and_the_honest_one_finishes(
    tmp_path, ft_base, ft_sft_dir, other_sft, monkeypatch, caplog, liar, tag, scale, why
):
    """A party with valid credentials whose cut tensors are non-finite, or
    x1e6 the other's, is dropped from the consortium in one line naming it;
    the run ends with its result (backbone checkpoint, result.json, merged
    model) for the honest party, no step of the liar's lie on the backbone."""
    node = {"news": 1, "reviews": 2}[liar]
    honest = "reviews" if liar == "news" else "news"
    lying_party(monkeypatch, node, tag, scale)
    out = tmp_path / "run"
    s = settings(2, rounds=2, local_steps=2)
    with caplog.at_level("WARNING"):
        summary = run_splitfed(
            ft_base, {"news": ft_sft_dir, "reviews": other_sft}, out, s
        )
    drops = [
        r.getMessage()
        for r in caplog.records
        if "dropped in round" in r.getMessage() and "rejected update" in r.getMessage()
    ]
    caught = 1 if liar == "reviews" else 2  # the round it was caught in
    assert len(drops) == s.rounds - caught + 1  # one line a round, from then on
    assert f"party {liar} dropped in round {caught}" in drops[0]
    assert why in drops[0]
    assert not any(f"party {honest}" in r.getMessage() for r in caplog.records)
    assert list(summary["dropped"]) == [liar]
    # the honest party's run ended with its result
    assert json.loads((out / "result.json").read_text())["status"] == "completed"
    assert len(step_losses(out / "parties" / honest)) == s.total_local_steps
    rounds = [r for r in read_metrics(out / "metrics.jsonl") if "link_bytes" in r]
    assert [r["accepted"] for r in rounds] == [1 + (caught > 1)] + [1]
    # the backbone took the honest party's steps and the liar's honest ones
    honest_steps = s.total_local_steps + (caught - 1) * s.local_steps
    assert summary["backbone_steps"] == honest_steps
    b_steps = ckpt.complete_steps(Path(summary["backbone"]) / "checkpoints")
    assert b_steps[-1] == honest_steps
    merged, _ = load_run_model(out / "merged")
    assert all(bool(torch.isfinite(p).all()) for p in merged.state_dict().values())
    assert math.isfinite(summary["final_global_valid_loss"])


def test_the_cut_bound_is_the_federated_guards(monkeypatch):
    """The backbone bounds a member's cut tensors by the guard's own rule
    (``norm_bound``): k times the lower median of the members' values."""
    from aisyn.fl.guard import norm_bound
    from aisyn.split.centre.consortium import SharedBackbone

    b = SharedBackbone.__new__(SharedBackbone)
    b.cut_bound, b.cut_ratio, b.cut_rms = norm_bound, 3.0, {}
    assert b.cut_problem("a", {"activations": 1e6}) is None  # nothing to compare
    b.applied("a", {"activations": 1.0, "gradients": 2.0})
    b.applied("a", {"activations": 0.5, "gradients": 4.0})  # the largest is kept
    assert b.cut_problem("b", {"activations": 3.0, "gradients": 12.0}) is None
    assert "activations is 3.1" in b.cut_problem("b", {"activations": 3.1})
    assert "gradients times" in b.cut_problem("b", {"gradients": 12.5})
    assert b.cut_problem("a", {"activations": 1e9}) is None  # not its own
    b.cut_ratio = 0.0  # max-norm-ratio 0: no bound
    assert b.cut_problem("b", {"activations": 1e9}) is None

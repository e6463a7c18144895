"""The reference's table over methods, partitions and seeds
(``aisyn experiment compare --preset reference|reference-ci``): its
judgement of the best method, its summary line, and a whole micro table."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from test_compare import MICRO, write_corpus

from aisyn.experiments.evaluator import Evaluator, ScoreCache
from aisyn.experiments.table import method_settings, run_table, summarise
from aisyn.testbed.presets import PRESETS

NAMES = ["news", "reviews"]
SUMMARY = re.compile(
    r"federated - fusion: ([+-]\d+\.\d) / ([+-]\d+\.\d) pts \(min over domains "
    r"([+-]\d+\.\d)\), best standalone ([+-]\d+\.\d), method ([\w+]+), "
    r"rounds (\d+|never)"
)


def row(regime, kind, seed, news, reviews, **info):
    return {
        "regime": regime,
        "kind": kind,
        "seed": seed,
        "acc_news": news,
        "acc_reviews": reviews,
        "loss_news": 1.0,
        "loss_reviews": 1.0,
        **info,
    }


def fed(method, partition, seed, news, reviews, curve):
    return row(
        f"federated ({method}, {partition})", "federated", seed, news, reviews,
        method=method, partition=partition, rounds=len(curve) - 1,
        clients=2 if partition == "domains" else 4,
        bytes_per_round=1e6, wall_per_round_s=2.0,
        curve=[{"round": r, "news": a, "reviews": b} for r, (a, b) in enumerate(curve)],
    )  # fmt: skip


def test_the_best_method_is_judged_at_its_worst_partition():
    # Prepare: fusion 40 / 50; standalone models 35 / 30 (news) and 25 / 44
    # (reviews).
    # fedavg is best on the domain split but 6 points short under Dirichlet;
    # scaffold is 1.5 short at worst (news, Dirichlet), reaching fusion - 1 on
    # both domains in round 2 (domains) and round 3 (Dirichlet)
    rows = [row("without ft (base)", "base", None, 20.0, 25.0)]
    for seed, wiggle in ((1, -0.5), (2, 0.5)):
        rows += [
            row("news ft (standalone)", "standalone", seed, 35 + wiggle, 30.0),
            row("reviews ft (standalone)", "standalone", seed, 25.0, 44 + wiggle),
            row("fusion", "fusion", seed, 40 + wiggle, 50 - wiggle),
            row("fusion x2", "parallel-fusion", seed, 38.0, 49.0, clients=2),
            row("fusion x4", "parallel-fusion", seed, 36.0, 48.0, clients=4),
            fed("fedavg", "domains", seed, 41.0, 50.0, [(20, 25), (41, 50)]),
            fed("fedavg", "dirichlet-0.1", seed, 34.0, 49.0, [(20, 25), (34, 49)]),
            fed(
                "scaffold", "domains", seed, 40.0, 50.0,
                [(20, 25), (30, 40), (39.5, 49.2), (40, 50)],
            ),
            fed(
                "scaffold", "dirichlet-0.1", seed, 38.5, 49.5,
                [(20, 25), (30, 40), (38, 48), (39, 49.5)],
            ),
        ]  # fmt: skip
    # Execute
    table = summarise(rows, NAMES, PRESETS["reference-ci"])
    # Assert: the groups are seed means with their spread
    fusion = next(g for g in table["table"] if g["kind"] == "fusion")
    assert fusion["seeds"] == 2 and fusion["acc_news"] == 40.0
    assert fusion["sd_news"] == pytest.approx(0.7071, abs=1e-4)
    best = table["best"]
    assert best["method"] == "scaffold" and best["partition"] == "dirichlet-0.1"
    assert best["vs_fusion"] == {"news": -1.5, "reviews": -0.5}
    # ... and against fusion at its own parallelism (4 clients: 36 / 48)
    assert best["vs_parallel_fusion"] == {"news": 2.5, "reviews": 1.5}
    by_regime = {g["regime"]: g for g in table["table"]}
    assert by_regime["federated (fedavg, domains)"]["vs_parallel_fusion"] == {
        "news": 3.0,
        "reviews": 1.0,
    }
    # the best standalone model is reviews' (34.5 on average, news' 32.5):
    # (38.5 + 49.5) / 2 - 34.5, not against each domain's own specialist
    # ((38.5 - 35 + 49.5 - 44) / 2 = 4.5)
    assert best["vs_best_standalone"] == pytest.approx(9.5)
    # fusion is measured against it too (45 - 34.5), the base is not
    assert fusion["vs_best_standalone"] == pytest.approx(10.5)
    base = next(g for g in table["table"] if g["kind"] == "base")
    assert "vs_best_standalone" not in base
    assert best["rounds_to_fusion_all"] == 3 and not best["goal_fusion"]
    assert table["summary"] == (
        "federated - fusion: -1.5 / -0.5 pts (min over domains -1.5), best "
        "standalone +9.5, method scaffold, rounds 3"
    )
    assert SUMMARY.fullmatch(table["summary"])


def test_a_table_method_is_a_strategy_and_its_options_or_one_line():
    preset = PRESETS["reference-ci"]
    assert method_settings("fedavg", preset) == {"strategy": "fedavg"}
    assert method_settings("scaffold+kept", preset) == {
        "strategy": "scaffold",
        "local_optimizer": "kept",
    }
    # +sqrt: the clients' rate x sqrt(K), K the partition's clients (4 here),
    # and it reaches the clients' training settings
    from aisyn.experiments.compare import federated_settings

    four = {f"client{i}": f"/parts/part{i}" for i in range(4)}
    settings = method_settings("scaffold+kept+sqrt", preset, four)
    assert settings["lr"] == pytest.approx(2 * preset.lr)
    assert federated_settings(preset, 4, "cpu", **settings).train.lr == settings["lr"]
    two = method_settings("fedavg+sqrt", preset, {"news": "a", "reviews": "b"})
    assert two["lr"] == pytest.approx(preset.lr * 2**0.5)
    for bad, what in [
        ("scaffold+warm", "'warm' is no option"),
        ("scaffold+kept+kept", "'kept' is no option \\(or twice\\)"),
        ("fedsgd+kept", "unknown strategy 'fedsgd'"),
    ]:
        with pytest.raises(ValueError, match=what) as e:
            method_settings(bad, preset)
        assert "\n" not in str(e.value)


def test_a_method_that_never_reaches_fusion_says_never():
    rows = [
        row("news ft (standalone)", "standalone", 1, 30.0, 20.0),
        row("reviews ft (standalone)", "standalone", 1, 20.0, 30.0),
        row("fusion", "fusion", 1, 40.0, 40.0),
        fed("fedavg", "domains", 1, 30.0, 30.0, [(10, 10), (30, 30)]),
    ]
    table = summarise(rows, NAMES, PRESETS["reference-ci"])
    assert table["summary"].endswith("method fedavg, rounds never")
    assert SUMMARY.fullmatch(table["summary"])


@pytest.mark.heavy
def test_a_micro_table_has_every_regime_curve_and_the_summary(tmp_path, monkeypatch):
    # Prepare: two small domains, a public corpus of its own (the reference
    # presets' is Debian's fortunes), two methods over two partitions, 2 seeds
    monkeypatch.setenv("AISYN_CACHE", str(tmp_path / "cache"))
    news = write_corpus(tmp_path / "news.txt", "news", 120)
    reviews = write_corpus(tmp_path / "reviews.txt", "reviews", 120)
    public = write_corpus(tmp_path / "public.txt", "fortunes", 200)
    preset = replace(
        MICRO,
        name="micro-table",
        finetune_steps=8,
        rounds=2,
        public=(public,),
        methods=("fedavg", "scaffold+kept+epochs"),
        partitions=("domains", "dirichlet-1.0"),
        clients=4,
        seeds=(1, 2),
    )
    out = tmp_path / "table"
    # Execute
    table = run_table([news, reviews], preset, out, device="cpu")
    # Assert: every regime, each over both seeds
    regimes = {g["regime"]: g for g in table["table"]}
    assert set(regimes) == {
        "without ft (base)",
        "news ft (standalone)",
        "reviews ft (standalone)",
        "fusion",
        "news split ft",
        "reviews split ft",
        "splitfed (fedavg, domains)",
        *(
            f"federated ({m}, {p})"
            for m in ("fedavg", "scaffold+kept+epochs")
            for p in ("domains", "dirichlet-1.0")
        ),
        *(
            f"fusion at {k} clients' parallelism (batch x{k}, steps / {k})"
            for k in (2, 4)
        ),
    }
    for label, g in regimes.items():
        assert g["seeds"] == (1 if label.startswith("without") else 2), label
        for n in ("news", "reviews"):
            assert 0.0 <= g[f"acc_{n}"] <= 100.0
    # every federated run scored after each of its rounds, round 0 the start
    for m in ("fedavg", "scaffold+kept+epochs"):
        g = regimes[f"federated ({m}, dirichlet-1.0)"]
        assert [p["round"] for p in g["curve"]] == [0, 1, 2]
        assert g["bytes_per_round"] > 0 and g["wall_per_round_s"] > 0
    # fusion at each partition's parallelism: the pooled data in K x the batch
    # and 1/K of the steps; every federated group is judged against its own K
    for k, partition in ((2, "domains"), (4, "dirichlet-1.0")):
        run = out / "runs" / "seed-1" / f"fusion-x{k}"
        train = json.loads((run / "config.json").read_text())["train"]
        assert train["batch_size"] == MICRO.batch_size * k
        assert train["steps"] == preset.finetune_steps // k
        parallel = regimes[
            f"fusion at {k} clients' parallelism (batch x{k}, steps / {k})"
        ]
        g = regimes[f"federated (fedavg, {partition})"]
        assert g["clients"] == k
        assert g["vs_parallel_fusion"] == {
            n: pytest.approx(g[f"acc_{n}"] - parallel[f"acc_{n}"]) for n in NAMES
        }
    # SCAFFOLD moves twice FedAvg's bytes (its control variates ride along)
    ratio = (
        regimes["federated (scaffold+kept+epochs, domains)"]["bytes_per_round"]
        / regimes["federated (fedavg, domains)"]["bytes_per_round"]
    )
    assert ratio == pytest.approx(2.0, rel=0.01)
    # +epochs: each client's steps a round by its items, the preset's budget
    # (finetune-steps / rounds a round) in all; +kept: their AdamW kept
    from aisyn.data.sft import SFTData

    fed = out / "runs" / "seed-1" / "federated" / "scaffold+kept+epochs-dirichlet-1.0"
    steps, items = {}, {}
    for client in sorted((fed / "clients").iterdir()):
        lines = (client / "metrics.jsonl").read_text().splitlines()
        rounds = [r for r in map(json.loads, lines) if "round_loss" in r]
        steps[client.name] = rounds[-1]["step"] // preset.rounds
        part = out / "runs" / "seed-1" / "partitions" / "dirichlet-1.0"
        items[client.name] = len(SFTData.open(part / f"part{client.name[-1]}", "train"))
        assert (client / "optimizer").is_dir()
    epochs = preset.finetune_steps * preset.batch_size
    epochs /= preset.rounds * sum(items.values())
    assert steps == {
        c: max(1, round(epochs * n / preset.batch_size)) for c, n in items.items()
    }
    budget = preset.finetune_steps // preset.rounds
    assert abs(sum(steps.values()) - budget) <= len(steps)  # rounding only
    # four Dirichlet parts, each a client of its own folder
    parts = sorted((out / "runs" / "seed-1" / "partitions" / "dirichlet-1.0").iterdir())
    assert [p.name for p in parts] == ["part0", "part1", "part2", "part3"]
    md = (out / "table.md").read_text(encoding="utf-8")
    assert SUMMARY.fullmatch(md.strip().splitlines()[-1])
    assert (out / "accuracy_rounds.png").stat().st_size > 10_000
    saved = json.loads((out / "table.json").read_text())
    assert saved["summary"] == table["summary"]
    # A finished table resumed is the same table (nothing is trained again);
    # another recipe is refused in one line before anything is written
    # and scores no finished run's model again (they come from its cache)
    calls = []
    score = Evaluator.__call__
    monkeypatch.setattr(
        Evaluator, "__call__", lambda s, m, f: calls.append(f) or score(s, m, f)
    )
    again = run_table([news, reviews], preset, out, device="cpu", resume=True)
    assert again["table"] == table["table"]
    assert calls == []
    with pytest.raises(ValueError, match="other preset") as e:
        run_table([news, reviews], replace(preset, seeds=(3,)), out, resume=True)
    assert "\n" not in str(e.value)


class _CountingScorer:
    def __init__(self):
        self.calls = 0

    def __call__(self, model, fmt):
        self.calls += 1
        return {"format": fmt, "loss_x": float(model.weight.sum())}

    def accuracy(self, model, fmt):
        raise AssertionError("not cached")


def test_the_score_cache_scores_each_weights_once(tmp_path):
    import torch

    # Arrange
    scorer = _CountingScorer()
    cache = ScoreCache(scorer, tmp_path / "scores")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    # Execute / Assert: the same weights once; other weights, another format
    # or a torn cache file are scored afresh
    first = cache(model, "prompt")
    assert cache(model, "prompt") == first and scorer.calls == 1
    cache(model, "lm")
    assert scorer.calls == 2
    with torch.no_grad():
        model.weight[0, 0] += 1.0
    # an absolute tolerance: the sum is float32, and a relative one shrinks to
    # nothing where the sum + 1 lands near zero (an unseeded init once did)
    assert cache(model, "prompt")["loss_x"] == pytest.approx(
        first["loss_x"] + 1.0, abs=1e-5
    )
    assert scorer.calls == 3
    for f in (tmp_path / "scores").iterdir():
        f.write_text("{torn")
    cache(model, "prompt")
    assert scorer.calls == 4


def test_a_round_line_torn_by_a_kill_is_dropped_on_resume(tmp_path, monkeypatch):
    from aisyn.experiments import table as T

    # Arrange: two whole lines and a third cut short by a kill
    path = tmp_path / "rounds.jsonl"
    path.write_text('{"round": 0, "news": 1.0}\n{"round": 1, "news": 2.0}\n{"rou')
    monkeypatch.setattr(T, "load_run_model", lambda base, dev: (None, None))
    monkeypatch.setattr(T, "apply_method", lambda model, spec, seed: [])
    settings = T.FLSettings.from_dict({"min_clients": 2})
    # Execute: the scorer a resumed federation opens, then its next round
    scorer = T.RoundScorer(_Inputs(), settings, path)
    scorer.record(2, {"news": {"accuracy": 0.03}})
    # Assert: the torn line is gone, and the new one stands on its own
    assert [p["round"] for p in scorer.curve()] == [0, 1, 2]
    assert scorer.curve()[2]["news"] == pytest.approx(3.0)


class _Inputs:
    base, device = None, None


def test_the_rounds_chart_draws_fusion_at_each_panels_own_parallelism():
    from aisyn.experiments.accuracy_chart import rounds_figure

    def curve(method, partition, k):
        points = [{"round": 0, "news": 5.0, "reviews": 6.0}]
        points.append({"round": 1, "news": 20.0, "reviews": 22.0})
        return {
            "kind": "federated", "method": method, "partition": partition,
            "clients": k, "curve": points,
        }  # fmt: skip

    table = {
        "domains": NAMES,
        "table": [
            row("fusion", "fusion", 1, 23.0, 25.0),
            row("fusion x2", "parallel-fusion", 1, 21.0, 24.0, clients=2),
            row("fusion x4", "parallel-fusion", 1, 19.0, 23.0, clients=4),
            curve("scaffold", "domains", 2),
            curve("scaffold", "dirichlet-0.1", 4),
        ],
    }
    fig = rounds_figure(table)
    lines = [
        {ln.get_label(): ln.get_ydata()[0] for ln in ax.get_lines()} for ax in fig.axes
    ]
    # each panel: its method's curves, fusion, and fusion at its own K only
    assert lines[0]["fusion x2 news"] == 21.0 and "fusion x4 news" not in lines[0]
    assert lines[1]["fusion x4 reviews"] == 23.0 and "fusion x2 news" not in lines[1]
    assert lines[0]["fusion news"] == lines[1]["fusion news"] == 23.0

"""The comparison writes the reference's table (Markdown, CSV, JSON) and curves."""

from __future__ import annotations

import csv
import json
import logging
import shutil
from dataclasses import replace

import pytest

from aisyn.experiments.compare import run_compare
from aisyn.experiments.targets import check_targets
from aisyn.testbed.presets import PRESETS, Preset
from aisyn.train import checkpoint as ckpt


def write_corpus(path, name, n):
    from aisyn.data.corpora import load_corpus

    docs = [d.text.replace("\n", " ") for d in load_corpus(name).documents[:n]]
    path.write_text("\n".join(docs) + "\n", encoding="utf-8")
    return str(path)


def _check_report(out, names):
    md = (out / "report.md").read_text(encoding="utf-8")
    header = md.splitlines()[2]
    for col in (
        "regime",
        "device",
        "epochs/rounds",
        "steps",
        "wall time",
        "final loss",
        *[f"Acc {n}" for n in names],
        *[f"test loss {n}" for n in names],
    ):
        assert col in header
    rows = list(csv.DictReader((out / "report.csv").open(encoding="utf-8")))
    regimes = [r["regime"] for r in rows]
    assert regimes[0] == "without ft (base)"
    assert f"{names[0]} ft" in regimes and f"{names[1]} ft" in regimes
    assert f"{names[0]}+{names[1]} ft" in regimes
    assert f"{names[0]} split ft" in regimes and f"{names[1]} split ft" in regimes
    assert any(r.startswith("AIsyn federated") for r in regimes)
    assert any(r.startswith("AIsyn splitfed") for r in regimes)
    assert sum(r.startswith("client ") for r in regimes) == 2
    for r in rows:
        for n in names:
            assert 0.0 <= float(r[f"acc_{n}"]) <= 1.0
            assert int(r[f"acc_{n}_items"]) > 0
            assert float(r[f"test_loss_{n}"]) > 0
    # equal budget of optimizer steps across fine-tuned regimes
    steps = {r["regime"]: int(r["steps"]) for r in rows}
    fed = next(v for k, v in steps.items() if k.startswith("AIsyn federated"))
    splitfed = next(v for k, v in steps.items() if k.startswith("AIsyn splitfed"))
    assert steps[f"{names[0]} ft"] == steps[f"{names[0]}+{names[1]} ft"] == fed
    assert splitfed == fed  # the shared backbone takes every party's steps
    assert steps[f"{names[0]} split ft"] == steps[f"{names[0]} ft"]
    split = next(r for r in rows if r["regime"] == f"{names[0]} split ft")
    assert float(split["bytes_on_wire"]) > 0
    for regime in ("AIsyn federated", "AIsyn splitfed"):
        row = next(r for r in rows if r["regime"].startswith(regime))
        assert float(row["bytes_on_wire"]) > 0
    report = json.loads((out / "report.json").read_text())
    # The split regime takes standalone fine-tuning's steps: it scores the same.
    for n in names:
        assert report["targets"]["e_split_equals_standalone"][n]["pass"]
    assert set(report["targets"]) == {
        "e_split_equals_standalone",
        "a_standalone_2x_chance",
        "b_fed_vs_fusion_accuracy",
        "c_fed_vs_fusion_loss",
        "d_fed_beats_other_standalone",
    }
    plots = sorted(p.name for p in (out / "plots").glob("*.png"))
    # 2 standalone, fusion, federated global, 2 clients, splitfed, and the
    # accuracy chart
    assert len(plots) == 8 and "accuracy.png" in plots
    return rows


MICRO = Preset(
    name="micro",
    model=dict(vocab_size=8000, hidden_size=32, num_layers=3, num_heads=4, ffn_size=64),
    seq_len=48,
    pretrain_steps=4,
    pretrain_batch=4,
    per_document=2,
    test_per_document=2,
    max_test_items=16,
    finetune_steps=4,
    batch_size=4,
    warmup=1,
    rounds=1,
    eval_items=8,
)


@pytest.mark.heavy
def test_micro_comparison_produces_the_table(tmp_path, monkeypatch):
    # Prepare: two small corpora and a private cache (the base is built here)
    monkeypatch.setenv("AISYN_CACHE", str(tmp_path / "cache"))
    domains = [
        write_corpus(tmp_path / "news.txt", "news", 400),
        write_corpus(tmp_path / "reviews.txt", "reviews", 400),
    ]
    preset = MICRO
    # Execute
    report = run_compare(domains, preset, tmp_path / "report")
    # Assert
    _check_report(tmp_path / "report", ["news", "reviews"])
    assert report["rows"][0]["format"] == "lm"
    assert all(r["format"] == "prompt" for r in report["rows"][1:])
    # a second run into the same folder is refused (nothing is overwritten)
    with pytest.raises(FileExistsError):
        run_compare(domains, preset, tmp_path / "report")
    # some of the regimes: only those rows
    sub = run_compare(
        domains, preset, tmp_path / "some", regimes=["splitfed", "fusion"]
    )
    assert [r["regime"] for r in sub["rows"]] == [
        "without ft (base)",
        "news+reviews ft",
        "AIsyn splitfed (fedavg, full)",
    ]
    with pytest.raises(ValueError, match="--regimes fedsplit: expected some of"):
        run_compare(domains, preset, tmp_path / "bad", regimes=["fedsplit"])


@pytest.mark.heavy
def test_a_killed_comparison_resumes_to_the_same_rows(tmp_path, monkeypatch, caplog):
    """A comparison killed while its fusion run trained (after its
    checkpoint at three quarters of its steps) and before its report was
    written: ``resume`` trains fusion on from that checkpoint, leaves the
    finished split runs as they are, and writes the rows an uninterrupted
    comparison wrote. Another recipe, or a folder
    without a comparison, is refused in one line with nothing written."""
    from aisyn.experiments.report import REPORT_JSON

    # Prepare: an uninterrupted comparison of two regimes, then the kill
    monkeypatch.setenv("AISYN_CACHE", str(tmp_path / "cache"))
    domains = [
        write_corpus(tmp_path / "news.txt", "news", 400),
        write_corpus(tmp_path / "reviews.txt", "reviews", 400),
    ]
    out, regimes = tmp_path / "report", ["fusion", "split"]
    whole = run_compare(domains, MICRO, out, regimes=regimes)
    fusion = out / "runs" / "news_reviews"
    ckpts = fusion / "checkpoints"
    last = ckpt.latest(ckpts)
    assert last.name == f"step_{MICRO.finetune_steps:08d}"
    shutil.rmtree(last)
    kept = ckpts / f"step_{MICRO.finetune_steps * 3 // 4:08d}"
    (ckpts / ckpt.LATEST).write_text(kept.name)
    assert ckpt.latest(ckpts) is not None  # the quarter cadence kept it
    (fusion / "summary.json").unlink()
    (out / REPORT_JSON).unlink()
    split_metrics = (out / "runs" / "news_split" / "metrics.jsonl").read_bytes()
    # Refused: another recipe, and a folder that holds no comparison
    with pytest.raises(ValueError, match="holds a comparison of other regimes"):
        run_compare(domains, MICRO, out, regimes=["fusion"], resume=True)
    assert not (out / REPORT_JSON).exists()
    with pytest.raises(ValueError, match="holds no comparison"):
        run_compare(domains, MICRO, tmp_path / "none", resume=True)
    # Execute
    with caplog.at_level(logging.INFO, logger="aisyn"):
        resumed = run_compare(domains, MICRO, out, regimes=regimes, resume=True)
    # Assert: fusion went on from its checkpoint, not from its start; the
    # same rows; the finished split runs were not trained again
    assert f"resumed from {kept} (step {MICRO.finetune_steps * 3 // 4})" in caplog.text
    keys = ("regime", "steps", "acc_news", "acc_reviews", "loss_news", "loss_reviews")
    assert [{k: r[k] for k in keys} for r in resumed["rows"]] == [
        {k: r[k] for k in keys} for r in whole["rows"]
    ]
    assert (out / "runs" / "news_split" / "metrics.jsonl").read_bytes() == split_metrics
    assert (out / REPORT_JSON).is_file()


@pytest.mark.parametrize(
    "text", ["{not json", '{"domains": NaN}', "[1, 2]", '{"domains": "x"}']
)
def test_a_resume_of_a_corrupt_or_foreign_recipe_is_one_line(tmp_path, text):
    from aisyn.experiments.compare import RECIPE, check_same_comparison

    (tmp_path / RECIPE).write_text(text)
    recipe = {"domains": ["news"], "preset": {}, "regimes": [], "federated": {}}
    with pytest.raises(ValueError, match="^--resume: ") as e:
        check_same_comparison(tmp_path, recipe)
    assert "\n" not in str(e.value)
    assert (tmp_path / RECIPE).read_text() == text  # nothing rewritten


@pytest.mark.slow
def test_ci_preset_produces_the_table(tmp_path):
    run_compare(["news", "reviews"], PRESETS["ci"], tmp_path / "report")
    _check_report(tmp_path / "report", ["news", "reviews"])


def _row(regime, acc_news, acc_reviews, loss_news=5.0, loss_reviews=5.0, ci=0.02):
    def acc(a):
        return {"accuracy": a, "ci95": [a - ci, a + ci], "chance": 0.1, "items": 500}

    return {
        "regime": regime,
        "acc_news": acc(acc_news),
        "acc_reviews": acc(acc_reviews),
        "loss_news": loss_news,
        "loss_reviews": loss_reviews,
    }


def test_targets_are_judged_as_the_issue_states():
    # Prepare
    rows = [
        _row("news ft", 0.25, 0.15),
        _row("reviews ft", 0.14, 0.19),  # 19 % < 2 x chance
        _row("news+reviews ft", 0.26, 0.30, 5.00, 5.00),
        _row("AIsyn federated (fedavg, full)", 0.255, 0.27, 5.01, 5.05),
    ]
    # Execute
    t = check_targets(rows, ["news", "reviews"])
    # Assert
    assert t["e_split_equals_standalone"] == {}  # no split rows, nothing judged
    assert t["a_standalone_2x_chance"]["news"]["pass"]
    assert not t["a_standalone_2x_chance"]["reviews"]["pass"]
    assert t["b_fed_vs_fusion_accuracy"]["news"]["pass"]  # within 1 point
    assert not t["b_fed_vs_fusion_accuracy"]["reviews"]["pass"]  # 3 points, out of CI
    assert t["c_fed_vs_fusion_loss"]["news"]["pass"]
    assert not t["c_fed_vs_fusion_loss"]["reviews"]["pass"]  # 0.05 nats
    assert t["d_fed_beats_other_standalone"]["news"]["pass"]  # 0.255 > 0.14
    assert t["d_fed_beats_other_standalone"]["reviews"]["pass"]  # 0.27 > 0.15


def _full_row(regime, acc_news, acc_reviews, **kw):
    """A report row as ``run_compare`` writes it (what ``write_report`` reads)."""
    return {
        **_row(regime, acc_news, acc_reviews, **kw),
        "device": "CPU",
        "epochs_or_rounds": "-",
        "steps": 4,
        "wall_s": 1.0,
        "final_loss": 3.0,
        "format": "prompt",
    }


def _report(rows):
    return {
        "domains": ["news", "reviews"],
        "preset": {"name": "micro", "finetune_steps": 4},
        "rows": rows,
        "targets": check_targets(rows, ["news", "reviews"]),
    }


REGIMES = [
    ("news ft", 0.25, 0.15),
    ("reviews ft", 0.14, 0.19),
    ("news+reviews ft", 0.26, 0.30),
    ("AIsyn federated (fedavg, full)", 0.255, 0.27),
]


def test_accuracy_chart_labels_each_regimes_bars_with_its_numbers():
    from matplotlib.container import BarContainer

    from aisyn.experiments.accuracy_chart import accuracy_figure

    # Prepare
    report = _report([_full_row(*r) for r in REGIMES])
    # Execute
    fig = accuracy_figure(report)
    # Assert: one bar series per regime, labelled with it, whose heights are
    # its accuracies (%) on news and reviews and whose error bars its intervals
    ax = fig.axes[0]
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert [b.get_label() for b in bars] == [r[0] for r in REGIMES]
    for b, (_, news, reviews) in zip(bars, REGIMES, strict=True):
        heights = [p.get_height() for p in b.patches]
        assert heights == pytest.approx([100 * news, 100 * reviews])
        (segments,) = [c.get_segments() for c in b.errorbar.lines[2]]
        ends = [y for s in segments for y in (s[0][1], s[1][1])]
        assert ends == pytest.approx(
            [100 * news - 2, 100 * news + 2, 100 * reviews - 2, 100 * reviews + 2]
        )
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["chance"] + [r[0] for r in REGIMES]
    (chance,) = [c for c in ax.collections if c.get_label() == "chance"]
    assert [s[0][1] for s in chance.get_segments()] == pytest.approx([10.0])
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "news test items",
        "reviews test items",
    ]


def test_the_report_has_the_chart_and_a_targets_table(tmp_path):
    from aisyn.experiments.report import write_report

    # Execute
    write_report(tmp_path, _report([_full_row(*r) for r in REGIMES]), {})
    # Assert: the chart is written and linked; the targets are a table, not JSON
    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert (tmp_path / "plots" / "accuracy.png").stat().st_size > 0
    assert "![accuracy per domain, by regime](plots/accuracy.png)" in md
    targets = md.split("## Targets")[1].split("##")[0]
    assert "```" not in targets and "{" not in targets
    lines = [ln for ln in targets.splitlines() if ln.startswith("|")]
    assert lines[0] == "| target | domain | numbers | result |"
    assert (
        "| (a) standalone >= 2x chance on its own domain | reviews | "
        "accuracy 19.00 %, needed 20.00 % | **not met** |"
    ) in lines
    assert (
        "| (b) federated within 1 point of fusion, or inside fusion's 95 % interval "
        "| news | federated 25.50 %, fusion 26.00 %, fusion 95 % interval "
        "[24.0, 28.0] | met |"
    ) in lines
    assert (
        "| (c) federated test loss within 0.02 nats of fusion's | news | "
        "federated 5.0000, fusion 5.0000 | met |"
    ) in lines
    # (a), (b), (c), (d) for both domains; (e) has no split rows here
    assert len(lines) == 2 + 4 * 2


def _saved_recipe(tmp_path, preset: dict) -> dict:
    from aisyn.experiments.compare import RECIPE

    recipe = {"domains": ["news", "reviews"], "preset": preset}
    (tmp_path / RECIPE).write_text(json.dumps(recipe))
    return recipe


def test_a_resumed_table_may_add_methods_partitions_and_seeds_but_not_drop_them(
    tmp_path,
):
    from aisyn.experiments.compare import check_same_comparison

    # Arrange: a table saved with two methods, one partition, one seed
    table = PRESETS["reference-ci"]
    saved = json.loads(json.dumps(table.to_dict()))
    recipe = _saved_recipe(tmp_path, saved)
    grown = replace(
        table,
        methods=(*table.methods, "fedavgm"),
        partitions=(*table.partitions, "dirichlet-1.0"),
        seeds=(*table.seeds, 3),
    )
    # Execute / Assert: more of each axis goes on; fewer, or another setting, not
    check_same_comparison(tmp_path, {**recipe, "preset": grown.to_dict()})
    for changed in (
        replace(table, methods=table.methods[:1]),
        replace(table, seeds=(7,)),
        replace(table, lr=table.lr * 2),
    ):
        with pytest.raises(ValueError, match="holds a comparison of other preset"):
            check_same_comparison(
                tmp_path,
                {**recipe, "preset": json.loads(json.dumps(changed.to_dict()))},
            )


def test_a_table_saved_before_a_setting_existed_resumes_at_its_default(tmp_path):
    from aisyn.experiments.compare import check_same_comparison

    # Arrange: the recipe of a version without server_lr (it used FedAvgM's 1)
    preset = json.loads(json.dumps(PRESETS["reference-ci"].to_dict()))
    saved = {k: v for k, v in preset.items() if k != "server_lr"}
    recipe = _saved_recipe(tmp_path, saved)
    # Execute / Assert: the default is the same run; another value is not
    check_same_comparison(tmp_path, {**recipe, "preset": preset})
    with pytest.raises(ValueError, match="holds a comparison of other preset"):
        check_same_comparison(
            tmp_path, {**recipe, "preset": {**preset, "server_lr": 2.0}}
        )
    # ... and a saved setting the code no longer has is another recipe
    _saved_recipe(tmp_path, {**preset, "gone": 1})
    with pytest.raises(ValueError, match="holds a comparison of other preset"):
        check_same_comparison(tmp_path, {**recipe, "preset": preset})

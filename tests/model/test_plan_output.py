"""What ``aisyn split plan`` prints: identical ranks grouped on one line."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from aisyn.model.cost import PlanError
from aisyn.model.families import load_config
from aisyn.model.memory import Workload
from aisyn.model.segments import parse_partition
from aisyn.split.planner import PartySpec, evaluate, plan


def parties(a: str, b: str) -> dict[str, PartySpec]:
    return {"A": PartySpec.parse(a), "B": PartySpec.parse(b)}


def rank_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("  rank")]


@pytest.fixture(scope="module")
def plan_200b():
    """The bench's 200B plan: A sharded over 16 ranks, B's 61 blocks on 61
    pipeline stages."""
    cfg = load_config("200B")
    w = Workload(batch_size=128, micro_batch_size=16, dtype="bf16", schedule="window")
    cut = parse_partition("u:1,1", cfg)
    return evaluate("200B", cfg, cut, parties("A:1:16x80GB", "B:8:61x80GB"), w)


def test_identical_ranks_print_as_one_line(plan_200b):
    # Execute
    lines = rank_lines(plan_200b.render())
    # Assert: 16 + 61 ranks, two lines, each with the ranks' own figures
    assert len(lines) == 2, lines
    a_line, b_line = lines
    assert a_line.startswith(
        "  ranks 0–15 FSDP2 shards 1–16/16 of h[0:1] h[62:63] + embedding + ln_f"
    )
    assert b_line.startswith("  ranks 0–60 h[1:62] (1 block each)")
    ranks = plan_200b.to_dict()["parties"]
    assert {r["peak"] for r in ranks["A"]["ranks"]} == {
        plan_200b.loads["A"].memory_bytes
    }
    assert "peak   72.41 GiB" in a_line and "peak   56.36 GiB" in b_line
    assert f"{ranks['B']['ranks'][60]['params']:,} params" in b_line


def test_ranks_that_differ_keep_their_own_lines():
    from aisyn.split.planner import rank_groups

    cfg = load_config("tiny")
    # 3 ranks of A: hidden 128 and FFN 512 split 43/43/42 rows, and a
    # micro-batch of 3 one row each: rank 2 holds fewer parameters
    w = Workload(batch_size=6, micro_batch_size=3)
    cut = parse_partition("u:1,1", cfg)
    p = evaluate("tiny", cfg, cut, parties("A:1:3x1GB", "B:4:1GB"), w)
    # Execute
    groups = rank_groups(p.loads["A"].ranks)
    lines = rank_lines(p.render())
    # Assert
    assert [[r.rank for r in g] for g in groups] == [[0, 1], [2]]
    assert lines[0].startswith("  ranks 0–1 FSDP2 shards 1–2/3 of h[0:1] h[2:3]")
    assert lines[1].startswith("  rank 2   FSDP2 shard 3/3 of h[0:1] h[2:3]")
    a = p.loads["A"].ranks
    assert f"{a[0].params:,} params" in lines[0] and a[0].params != a[2].params
    assert f"{a[2].params:,} params" in lines[1]


def test_pipeline_stages_group_only_runs_of_the_same_size():
    cfg = load_config("13B")
    w = Workload(batch_size=8, micro_batch_size=1, dtype="bf16")
    cut = parse_partition("u:1,5", cfg)
    # B's 33 blocks on 8 stages: 5 on the first, 4 on each other
    p = evaluate("13B", cfg, cut, parties("A:1:80GB", "B:4:8x80GB"), w)
    # Execute
    lines = rank_lines(p.render())
    # Assert
    assert len(lines) == 2
    assert lines[0].startswith("  rank 0   h[1:6] ")
    assert lines[1].startswith("  ranks 1–7 h[6:34] (4 blocks each)")


# --- the 2.6B plans the README and docs/split.md quote -------------------------------

ROOT = Path(__file__).resolve().parents[2]


def planned(argv: list[str], capsys) -> str:
    from aisyn.cli import main

    assert main(argv) == 0
    return capsys.readouterr().out


def total_mem(out: str, party: str) -> str:
    """The ``total mem`` column of ``party``'s row, e.g. ``8.45 GiB``."""
    (row,) = [line for line in out.splitlines() if line.startswith(f"{party}  ")]
    return " ".join(row.split()[-4:-2])


def test_the_readme_and_docs_say_why_their_2p6b_plans_differ(capsys):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    docs = (ROOT / "docs" / "split.md").read_text(encoding="utf-8")
    # the README's command, and the figures it quotes for it and for the docs'
    m = re.search(
        r"`aisyn (split plan --model 2\.6B [^`]*)` picks the cut \(([^)]*)\)", readme
    )
    assert m, "the README's 2.6B plan"
    quoted = m.group(2)
    readme_out = planned(m.group(1).split(), capsys)
    assert "1 micro-batch(es) in flight" in readme_out
    (console,) = re.findall(r"\$ aisyn (split plan --model 2\.6B [^\n]*)", docs)
    docs_out = planned(console.split(), capsys)
    assert "--pipeline 2" in console and "3 micro-batch(es) in flight" in docs_out
    # Assert: the README names the difference and both sets of figures
    assert "--pipeline 2" in quoted and "3 in flight" in quoted
    for out in (readme_out, docs_out):
        assert f"A {total_mem(out, 'A')}, B {total_mem(out, 'B')}" in quoted
    # ... and the docs say it beside their block, with the README's figures
    after = docs[docs.index(console) :]
    note = after[after.index("```\n") : after.index("`--party NAME:THROUGHPUT")]
    assert "`--pipeline 2`" in note and "3 micro-batches in flight" in note
    assert total_mem(readme_out, "A") in note and total_mem(readme_out, "B") in note


def test_a_slow_plan_says_how_far_it_is(monkeypatch, caplog):
    from aisyn.split.planner import search as planner

    # a box where every cut is slow: the first word at once
    monkeypatch.setattr(planner, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(planner, "PROGRESS_EVERY_S", 3600.0)
    cfg = load_config("tiny")
    specs = list(parties("A:1:inf", "B:4:inf").values())
    # Execute
    with caplog.at_level(logging.INFO, logger="aisyn.split.planner.search"):
        planner.plan("tiny", cfg, specs, Workload())
    # Assert: one line, naming the model and how many cuts there are
    n = len(planner.candidates(cfg, "u", planner.MIN_A_BLOCKS))
    assert [r.getMessage() for r in caplog.records] == [
        f"planning tiny: weighed 0 of {n} u cuts (0 s)"
    ]


# --- a device set on which no cut fits ------------------------------------------------


def suggested(message: str) -> tuple[list[PartySpec], dict, str]:
    """The ``--party`` specs, workload flags and cut the refusal suggests."""
    m = re.search(r"the fewest devices that fit: ([^,]*), cut (\S+?)[;( ]", message)
    assert m, message
    words = m.group(1).split()
    specs = [
        PartySpec.parse(words[i + 1]) for i, w in enumerate(words) if w == "--party"
    ]
    flags = {
        w[2:].replace("-", "_"): int(words[i + 1])
        for i, w in enumerate(words)
        if w in ("--batch-size", "--micro-batch-size")
    }
    return specs, flags, m.group(2)


def refusal(model: str, specs: list[PartySpec], w: Workload) -> str:
    with pytest.raises(PlanError) as e:
        plan(model, load_config(model), specs, w)
    return str(e.value)


def with_devices(spec: PartySpec, devices: int) -> PartySpec:
    return PartySpec(spec.name, spec.throughput, spec.memory_bytes, devices)


def test_a_refusal_names_the_short_party_and_the_fewest_devices_that_fit():
    w = Workload(batch_size=8, micro_batch_size=1, dtype="bf16")
    given = [PartySpec.parse("A:1:80GB"), PartySpec.parse("B:4:2x16GB")]
    # Execute
    message = refusal("13B", given, w)
    # Assert: B is short at the balanced cut, A fits there and says so
    assert "at the balanced cut u:1,5, B needs " in message
    assert (
        "per device and has 2 x 14.90 GiB (A fits there, 37.72 GiB of 74.51 GiB)"
        in (message)
    )
    assert "A needs" not in message and "bf16" not in message  # already bf16
    # ... and the devices it suggests are a plan, with one fewer on B none is
    specs, flags, _cut = suggested(message)
    assert [s.name for s in specs] == ["A", "B"] and not flags
    a, b = specs
    assert (a.devices, a.memory_bytes) == (1, 80e9) and b.memory_bytes == 16e9
    fitted = plan("13B", load_config("13B"), specs, w)  # refused if it did not fit
    assert fitted.loads["B"].memory_bytes <= 16e9
    refusal("13B", [a, with_devices(b, b.devices - 1)], w)


@pytest.mark.heavy
def test_the_200b_refusal_points_to_more_devices():
    w = Workload(batch_size=8, micro_batch_size=1, dtype="bf16")
    given = [PartySpec.parse("A:1:32GB"), PartySpec.parse("B:4:80GB")]
    # Execute
    message = refusal("200B", given, w)
    # Assert: both are short at the balanced cut; no bf16 (the run is bf16)
    assert re.search(
        r"A needs .* per device and has 29\.80 GiB, and B needs .* has 74\.51", message
    )
    assert "fits there" not in message and "bf16" not in message
    specs, flags, _cut = suggested(message)
    # no number of 32 GB devices holds what each rank of A keeps whole (the
    # embedding, the top query layer, the head: 3.9e9 parameters with AdamW)
    a, b = specs
    assert a.memory_bytes > 32e9 and b.memory_bytes == 80e9
    assert a.devices > 1 and flags["micro_batch_size"] >= a.devices
    work = Workload(dtype="bf16", **flags)
    fitted = plan("200B", load_config("200B"), specs, work)
    assert all(fitted.loads[s.name].memory_bytes <= s.memory_bytes for s in specs)

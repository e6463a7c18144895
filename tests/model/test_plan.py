"""Planner arithmetic against parameter counts worked out by hand from the
reference configurations (seed 000's table), never from the code under test.

Per ordinary block: ln_1 + ln_2 (4h) + q/k/v/c projections (4h² + 4h) + MLP
(h·f + f + f·h + h); with f = 4h that is 12h² + 13h. The top query layer is
one more such block. Embeddings: word (V·h), position (S·h), query (S·h);
final LayerNorm 2h; the head is tied to the word embedding (no parameters).
"""

from __future__ import annotations

import json
import math

import pytest

from aisyn.model.cost import (
    RUNTIME_BYTES,
    PlanError,
    block_activation_bytes,
    module_sizes,
    parse_bytes,
    pipeline_stage_blocks,
)
from aisyn.model.families import build_model, load_config
from aisyn.model.memory import Workload
from aisyn.model.segments import parse_partition
from aisyn.split.planner import PartySpec, evaluate, exposure_warning, plan

# name: (layers incl. top query, hidden, V, seq)
REFERENCE = {
    "350M": (16, 1280, 40000, 1024),
    "2.6B": (32, 2560, 40000, 1024),
    "13B": (40, 5120, 40000, 1024),
    "200B": (64, 16384, 40000, 1024),
}


def block(h: int) -> int:
    return 12 * h * h + 13 * h


def parties(a: str = "A:1:inf", b: str = "B:4:inf") -> dict[str, PartySpec]:
    return {"A": PartySpec.parse(a), "B": PartySpec.parse(b)}


@pytest.mark.parametrize("name", list(REFERENCE))
def test_parameter_counts_of_the_reference_configs(name):
    L, h, V, S = REFERENCE[name]
    cfg = load_config(name)
    # Prepare: A = embedding + 2 blocks, then 3 blocks + ln_f + top query + head
    cut = parse_partition("u:2,3", cfg)
    # Execute
    p = evaluate(name, cfg, cut, parties(), Workload())
    # Assert
    a = (V + S) * h + 5 * block(h) + S * h + 2 * h + block(h)
    b = (L - 1 - 5) * block(h)
    assert p.loads["A"].params == a
    assert p.loads["B"].params == b
    assert p.total_params == (V + 2 * S) * h + L * block(h) + 2 * h


def test_2p6b_numbers_by_hand():
    L, h, V, S = REFERENCE["2.6B"]
    cfg = load_config("2.6B")
    w = Workload(batch_size=8, micro_batch_size=1, dtype="bf16", codec="none")
    p = evaluate("2.6B", cfg, parse_partition("u:0,4", cfg), parties(), w)
    a_params = (V + 2 * S) * h + 2 * h + 5 * block(h)
    b_params = 27 * block(h)
    a, b = p.loads["A"], p.loads["B"]
    assert (a.params, b.params) == (a_params, b_params)
    # Training FLOPs: 3 x forward; forward per token 24h² + 4Sh per block (f=4h)
    # and 2hV for the head; 8 x 1024 tokens per step.
    tokens = 8 * 1024
    per_block = 24 * h * h + 4 * S * h
    assert a.train_flops == pytest.approx(3 * tokens * (5 * per_block + 2 * h * V))
    assert b.train_flops == pytest.approx(3 * tokens * 27 * per_block)
    # bf16 weights and grads (2 B each), AdamW m and v + fp32 master (12 B)
    assert a.weights_bytes == 2 * a_params
    assert a.grads_bytes == 2 * a_params
    assert b.optimizer_bytes == 12 * b_params
    # Activations, one micro-batch of 1 x 1024 in flight: per block eight
    # (T, h) and two (T, 4h) bf16 tensors, and per token two LayerNorms' mean
    # and rstd and one log-sum-exp per head in fp32 (fused attention: no
    # T x T scores).
    per_block_act = 1024 * (2 * (8 * h + 2 * 4 * h) + 4 * (4 + 32))
    assert b.activation_bytes == pytest.approx(27 * per_block_act)
    # B's peak: runtime, weights, gradients, optimizer and activations
    assert b.memory_bytes == pytest.approx(
        RUNTIME_BYTES + 16 * b_params + 27 * per_block_act
    )
    # Each way per step: an activation and a gradient, 8 x 1024 x h bf16 values
    assert a.sent_bytes == b.sent_bytes == 2 * 8 * 1024 * h * 2
    assert a.received_bytes == b.sent_bytes


def test_int8_and_fp32_wire_sizes():
    cfg = load_config("350M")
    cut = parse_partition("u:0,0", cfg)
    h = 1280
    fp32 = evaluate("350M", cfg, cut, parties(), Workload(batch_size=4, dtype="fp32"))
    int8 = evaluate(
        "350M", cfg, cut, parties(), Workload(batch_size=4, dtype="fp32", codec="int8")
    )
    values = 2 * 4 * 1024 * h
    assert fp32.loads["A"].sent_bytes == values * 4
    assert int8.loads["A"].sent_bytes == pytest.approx(values * (1 + 4 / 64))


def test_plan_balances_compute_by_throughput():
    cfg = load_config("2.6B")
    w = Workload(batch_size=8, micro_batch_size=1, dtype="bf16")
    # Execute: B four times as fast as A
    chosen = plan("2.6B", cfg, list(parties().values()), w)
    # Assert: no other U-shape cut has a lower pipelined step time, and A's
    # FLOPs share is about 1/5 (the reference's ~20 % / 80 %).
    n = cfg.num_layers - 1
    sizes = module_sizes(build_model(cfg, device="meta"))
    for f in range(1, n):
        for k in range(1, n - f):
            cut = parse_partition(f"u:{f},{k}", cfg)
            other = evaluate("2.6B", cfg, cut, parties(), w, sizes)
            assert chosen.pipelined_time <= other.pipelined_time * (1 + 1e-9)
    share = chosen.loads["A"].train_flops / (
        chosen.loads["A"].train_flops + chosen.loads["B"].train_flops
    )
    assert 0.15 < share < 0.25


def test_plan_respects_memory_limits():
    cfg = load_config("2.6B")
    w = Workload(batch_size=8, micro_batch_size=1, dtype="bf16")
    free = plan("2.6B", cfg, list(parties().values()), w)
    # A gets a little less memory than the balanced cut needs: fewer blocks on A
    limit = free.loads["A"].memory_bytes - 1
    tight = plan("2.6B", cfg, list(parties(f"A:1:{limit:.0f}B").values()), w)
    assert tight.loads["A"].memory_bytes <= limit
    assert tight.partition != free.partition
    with pytest.raises(PlanError, match="no u cut of 2.6B fits"):
        plan("2.6B", cfg, list(parties("A:1:1GB").values()), w)


def test_200b_is_planned_without_allocating_it():
    cfg = load_config("200B")  # ~207e9 parameters: 800+ GB if it were built
    p = plan("200B", cfg, list(parties("A:1:1TB", "B:10:inf").values()), Workload())
    L, h, V, S = REFERENCE["200B"]
    assert p.total_params == (V + 2 * S) * h + L * block(h) + 2 * h


@pytest.mark.parametrize(
    "text,match",
    [
        ("A:1", "NAME:THROUGHPUT:MEMORY"),
        ("C:1:1GB", "must be A"),
        ("A:fast:1GB", "not a number"),
        ("A:0:1GB", "positive"),
        ("A:1:lots", "expected e.g. 80GB"),
    ],
)
def test_bad_party_specs(text, match):
    with pytest.raises(PlanError, match=match):
        PartySpec.parse(text)


def test_parse_bytes_units():
    assert parse_bytes("80GB") == 80e9
    assert parse_bytes("24GiB") == 24 * 2**30
    assert math.isinf(parse_bytes("inf"))


def test_plan_keeps_a_block_on_each_side_of_a_by_default():
    """Unconstrained, the 2.6B plan for a 4x faster B is u:0,4: the raw token
    embeddings would cross, and anyone who knows the embedding inverts them."""
    cfg = load_config("2.6B")
    w = Workload(batch_size=8, micro_batch_size=1, dtype="bf16")
    # Execute
    default = plan("2.6B", cfg, list(parties().values()), w)
    unconstrained = plan("2.6B", cfg, list(parties().values()), w, min_a_blocks=0)
    # Assert
    assert default.partition.front >= 1 and default.partition.back >= 1
    assert exposure_warning(default.partition) is None
    assert unconstrained.partition.front == 0
    assert "raw token embeddings" in exposure_warning(unconstrained.partition)
    two = plan("2.6B", cfg, list(parties().values()), w, shape="two-way")
    assert two.partition.front >= 1
    with pytest.raises(PlanError, match="B needs at least one"):
        plan("tiny", load_config("tiny"), list(parties().values()), w, min_a_blocks=2)


# --- a party on several devices -----------------------------------------------------


@pytest.mark.parametrize("n,ranks", [(1, 1), (7, 3), (8, 8), (37, 8), (61, 61)])
def test_pipeline_stages_follow_numpy_array_split(n, ranks):
    import numpy

    # Execute
    stages = pipeline_stage_blocks(n, ranks)
    # Assert: numpy's split of the block indices, as ranges
    want = [list(a) for a in numpy.array_split(numpy.arange(n), ranks)]
    assert [list(r) for r in stages] == want


@pytest.mark.parametrize("n,ranks", [(3, 4), (5, 0)])
def test_pipeline_stages_refuse_a_stage_without_blocks(n, ranks):
    with pytest.raises(PlanError, match=f"{ranks} pipeline stages"):
        pipeline_stage_blocks(n, ranks)


def test_device_sets_parse():
    assert PartySpec.parse("B:4:8x80GB") == PartySpec("B", 4.0, 80e9, 8)
    assert PartySpec.parse("B:4:80GB") == PartySpec("B", 4.0, 80e9, 1)
    for bad in ("B:4:0x80GB", "B:4:8x", "B:4:x80GB"):
        with pytest.raises(PlanError, match="--party"):
            PartySpec.parse(bad)


def test_per_rank_parameters_are_the_meta_models():
    # Prepare: 13B, B's 37 blocks over 8 devices; the meta model counts
    cfg = load_config("13B")
    model = build_model(cfg, device="meta")
    cut = parse_partition("u:1,1", cfg)
    w = Workload(batch_size=8, micro_batch_size=1, dtype="bf16")
    # Execute
    p = evaluate("13B", cfg, cut, parties(b="B:4:8x80GB"), w)
    one = evaluate("13B", cfg, cut, parties(b="B:4:80GB"), w)
    # Assert: each rank's parameters are its blocks' (numpy's split of h[1:38])
    ranks = p.loads["B"].ranks
    assert [r.blocks for r in ranks] == [
        tuple(range(1 + s.start, 1 + s.stop)) for s in pipeline_stage_blocks(37, 8)
    ]
    for r in ranks:
        want = sum(
            t.numel() for i in r.blocks for t in model.transformer.h[i].parameters()
        )
        assert r.params == want
        assert r.weights_bytes == 2 * want and r.optimizer_bytes == 12 * want
    assert sum(r.params for r in ranks) == p.loads["B"].params
    # one device: one rank holding everything, the whole party's numbers
    (only,) = one.loads["B"].ranks
    assert only.params == one.loads["B"].params == p.loads["B"].params
    assert one.loads["B"].memory_bytes > 5 * p.loads["B"].memory_bytes


def test_schedules_hold_their_micro_batches():
    cfg = load_config("2.6B")
    cut = parse_partition("u:1,1", cfg)
    m, R = 8, 4
    got = {}
    for schedule in ("gpipe", "1f1b", "window"):
        w = Workload(
            batch_size=m,
            micro_batch_size=1,
            dtype="bf16",
            schedule=schedule,
            in_flight=3,
        )
        p = evaluate("2.6B", cfg, cut, parties(b=f"B:4:{R}x80GB"), w)
        got[schedule] = p.loads["B"].ranks
    # GPipe: every stage holds all m micro-batches; 1F1B: stage k at most R - k
    assert [r.in_flight for r in got["gpipe"]] == [m] * R
    assert [r.in_flight for r in got["1f1b"]] == [4, 3, 2, 1]
    # the torchrun compute party: every stage holds the link's window
    assert [r.in_flight for r in got["window"]] == [3] * R
    per_block = block_activation_bytes(cfg, 1, 1024, "bf16")
    for r in got["gpipe"]:
        assert r.activation_bytes == pytest.approx(len(r.blocks) * per_block * m)


def test_a_device_set_too_small_is_refused_with_the_numbers():
    cfg = load_config("13B")
    w = Workload(batch_size=8, micro_batch_size=1, dtype="bf16")
    # Execute / Assert: no cut fits B on 2 x 16 GB ...
    with pytest.raises(PlanError, match=r"B needs .* per device and has 2 x"):
        plan("13B", cfg, list(parties("A:1:80GB", "B:4:2x16GB").values()), w)
    # ... and a given cut names the rank and its numbers
    p = evaluate("13B", cfg, parse_partition("u:1,1", cfg), parties(b="B:4:2x80GB"), w)
    (first, second) = p.misfits()
    assert first.startswith("B rank 0 (h[1:20]) needs ")
    assert "optimizer " in first and "its device has 74.51 GiB" in first
    # ... and more devices than a micro-batch's rows are no plan at all (9
    # devices for tiny's B are sharded ranks, each needing a row)
    with pytest.raises(PlanError, match="can use the devices.* at least 9"):
        plan("tiny", load_config("tiny"), list(parties(b="B:1:9x1GB").values()), w)


def test_cli_plan_prints_ranks_and_refuses_a_cut_that_does_not_fit(capsys):
    from aisyn.cli import main

    # Execute
    main(
        ["split", "plan", "--model", "13B", "--party", "A:1:80GB"]
        + ["--party", "B:4:8x80GB"]
    )
    out = capsys.readouterr().out
    # Assert
    assert "B per rank (gpipe;" in out and "  ranks 1–7 h[6:34] (4 blocks each)" in out
    rc = main(
        ["split", "plan", "--model", "13B", "--party", "A:1:80GB"]
        + ["--party", "B:4:2x80GB", "--cut", "u:1,1"]
    )
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cut u:1,1 does not fit: B rank 0" in err[0]


# --- activations: the tensors autograd saves -----------------------------------------


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_block_activations_are_what_autograd_saves(autocast):
    import torch

    from aisyn.model.pangu import PanguConfig

    # Prepare: one block of a small PanGu-α, every saved tensor recorded
    cfg = PanguConfig(
        vocab_size=100,
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        ffn_size=192,
        seq_len=48,
    )
    model = build_model(cfg, seed=0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randn(2, 48, 64, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    # Execute
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        model.transformer.h[0](x)
    # Assert: the saved activations and autocast's bf16 weight copies
    cache = 2 * cfg.block_matmul_weights if autocast else 0
    want = block_activation_bytes(cfg, 2, 48, "fp32", autocast=autocast)
    assert sum(saved.values()) == want + cache


def test_checkpointing_and_autocast_in_the_memory():
    # Prepare: 2.6B's B (h[1:30]) on 2 devices, 8 micro-batches under GPipe
    cfg = load_config("2.6B")
    cut = parse_partition("u:1,1", cfg)
    h, T, m = 2560, 1024, 8
    plain = Workload(batch_size=m, micro_batch_size=1, dtype="fp32")
    # Execute
    loads = {
        name: evaluate("2.6B", cfg, cut, parties(b="B:4:2x80GB"), w).loads["B"]
        for name, w in {
            "plain": plain,
            "ac": Workload(**{**plain.__dict__, "activation_checkpointing": True}),
            "bf16": Workload(**{**plain.__dict__, "autocast": True}),
        }.items()
    }
    # Assert: checkpointed, each stage keeps its n blocks' fp32 inputs for
    # every micro-batch, and one block's activations while it recomputes it
    full = block_activation_bytes(cfg, 1, T, "fp32")
    assert [len(r.blocks) for r in loads["ac"].ranks] == [15, 14]
    for r in loads["ac"].ranks:
        n = len(r.blocks)
        assert r.activation_bytes == n * m * T * h * 4 + full
        assert loads["plain"].ranks[r.rank].activation_bytes == n * m * full
    # autocast: fp32 weights, grads and AdamW, a bf16 copy of each block's
    # matrices, and the activations of the mixed-precision block
    for r, p in zip(loads["bf16"].ranks, loads["plain"].ranks, strict=True):
        assert r.weights_bytes == p.weights_bytes == 4 * r.params
        assert r.optimizer_bytes == p.optimizer_bytes == 8 * r.params
        n = len(r.blocks)
        assert r.cache_bytes == 2 * n * cfg.block_matmul_weights
        assert r.activation_bytes == n * m * block_activation_bytes(
            cfg, 1, T, "fp32", autocast=True
        )
    with pytest.raises(PlanError, match="autocast keeps fp32 parameters"):
        Workload(dtype="bf16", autocast=True)


def test_cli_plan_of_the_data_is_the_training_memory_check(capsys, news_data):
    """What ``aisyn split plan --data`` prints for a CPU fp32 run is what the
    trainers' memory check estimates for it (the same function), for the
    model ``aisyn train`` builds on that data (its tokenizer's vocabulary)."""
    from aisyn.cli import main
    from aisyn.train.memory import party_bytes

    # Prepare: the 350M preset's vocabulary is 40 000, the data's 8 000
    argv = ["split", "plan", "--model", "350M", "--data", str(news_data)]
    argv += ["--party", "A:1:inf", "--party", "B:1:inf", "--cut", "u:1,1"]
    argv += ["--dtype", "fp32", "--batch-size", "1", "--json"]
    # Execute
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    # Assert
    cfg = load_config("350M", vocab_size=8000)
    cut = parse_partition("u:1,1", cfg)
    for p in ("A", "B"):
        printed = d["parties"][p]["memory_bytes"]["total"]
        assert printed == party_bytes(cfg, cut, p, 1, 32)
    assert d["workload"]["seq_len"] == 32


def test_rank_bytes_is_what_the_plan_prints_per_rank():
    from aisyn.train.memory import rank_bytes

    cfg = load_config("2.6B")
    cut = parse_partition("u:1,1", cfg)
    w = Workload(batch_size=4, micro_batch_size=1, dtype="fp32", schedule="1f1b")
    # Execute
    p = evaluate("2.6B", cfg, cut, parties(b="B:4:3x80GB"), w)
    got = rank_bytes(cfg, cut, "B", 3, 1, 1024, 4, schedule="1f1b")
    # Assert
    assert got == [r.memory_bytes for r in p.loads["B"].ranks]
    # more ranks than B's 29 blocks: sharded ranks, a row of each micro-batch
    # each (tests/model/test_plan_sharded.py has their figures)
    with pytest.raises(PlanError, match="at least 30; or give B at most 29"):
        rank_bytes(cfg, cut, "B", 30, 1, 1024)
    assert len(rank_bytes(cfg, cut, "B", 30, 30, 1024)) == 30

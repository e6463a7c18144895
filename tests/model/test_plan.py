"""Planner arithmetic against parameter counts worked out by hand from the
reference configurations (seed 000's table), never from the code under test.

Per ordinary block: ln_1 + ln_2 (4h) + q/k/v/c projections (4h² + 4h) + MLP
(h·f + f + f·h + h); with f = 4h that is 12h² + 13h. The top query layer is
one more such block. Embeddings: word (V·h), position (S·h), query (S·h);
final LayerNorm 2h; the head is tied to the word embedding (no parameters).
"""

from __future__ import annotations

import math

import pytest

from aisyn.model.families import build_model, load_config
from aisyn.model.plan import (
    RUNTIME_BYTES,
    PartySpec,
    PlanError,
    Workload,
    evaluate,
    exposure_warning,
    module_sizes,
    parse_bytes,
    plan,
)
from aisyn.model.segments import parse_partition

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
    # B's peak: runtime, weights, optimizer and the larger of its gradients
    # (54 GB) and activations (2.3 GB)
    assert b.memory_bytes == pytest.approx(
        RUNTIME_BYTES + 2 * b_params + 12 * b_params + 2 * b_params
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

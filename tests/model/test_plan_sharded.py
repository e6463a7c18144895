"""The planner's sharded layouts: a data party on several devices, and a
compute party with more devices than blocks, FSDP2-sharded over all of them.

The expected figures are worked out here from the meta model's parameters
(``torch.chunk`` of each parameter's dim 0, as FSDP2's ``Shard(0)`` cuts it)
and checked once against FSDP2 itself (``fully_shard`` on a fake process
group of R ranks, one process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from aisyn.model.cost import PlanError, block_activation_bytes
from aisyn.model.families import build_model, load_config
from aisyn.model.memory import Workload
from aisyn.model.segments import parse_partition
from aisyn.split.planner import PartySpec, evaluate, plan

#: tiny with 6 ordinary blocks (+ the top query layer); cut u:2,2 leaves A
#: h[0:2] + h[4:6] and the ends, B h[2:4]
CFG = dict(num_layers=7)
CUT = "u:2,2"
A_BLOCKS = (0, 1, 4, 5)
B_BLOCKS = (2, 3)
T = 32


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config("tiny", **CFG)
    return cfg, build_model(cfg, device="meta"), parse_partition(CUT, cfg)


def parties(a: str, b: str) -> dict[str, PartySpec]:
    return {"A": PartySpec.parse(a), "B": PartySpec.parse(b)}


def chunk_numel(module: torch.nn.Module, k: int, ranks: int) -> int:
    """Rank k's share of ``module``'s parameters: torch.chunk of dim 0."""
    total = 0
    for p in module.parameters():
        chunks = torch.arange(p.shape[0]).chunk(ranks)
        rows = len(chunks[k]) if k < len(chunks) else 0
        total += rows * (p.numel() // p.shape[0])
    return total


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("ranks,micro", [(2, 3), (3, 3)])
def test_data_party_ranks_are_the_formula_from_the_modules(tiny, ranks, micro):
    cfg, model, cut = tiny
    lay = cfg.layout
    w = Workload(batch_size=2 * micro, micro_batch_size=micro, seq_len=T, in_flight=2)
    # Execute
    p = evaluate("tiny", cfg, cut, parties(f"A:1:{ranks}x1GB", "B:1:1GB"), w)
    # Assert: every rank keeps its chunks of A's blocks and the ends whole
    a = p.loads["A"]
    assert a.layout == "sharded" and len(a.ranks) == ranks
    ends = sum(
        numel(model.get_submodule(m)) for m in dict.fromkeys(lay.embed + lay.head)
    )
    block = numel(model.transformer.h[0])
    rows = [len(r) for r in torch.arange(micro).tensor_split(ranks)]
    h, V = cfg.hidden_size, cfg.vocab_size
    for k, r in enumerate(a.ranks):
        shard = sum(chunk_numel(model.transformer.h[i], k, ranks) for i in A_BLOCKS)
        held = ends + shard
        assert r.blocks == A_BLOCKS and r.shard == (k, ranks)
        assert r.params == held and r.shard_params == shard
        assert r.weights_bytes == 4 * held  # fp32
        assert r.grads_bytes == 4 * held  # reduce-scattered: sharded too
        assert r.optimizer_bytes == 8 * held  # AdamW's two moments
        assert r.gathered_bytes == 4 * block  # one block all-gathered
        # 4 blocks + the top query layer, the head's tensors, the ids: of its
        # rows, for the link's window of 2 micro-batches
        n = rows[k]
        per_micro = 5 * block_activation_bytes(cfg, n, T, "fp32")
        per_micro += 2 * n * T * h * 4 + n * T * V * (4 + 4) + n * T * 16
        assert r.rows == n and r.in_flight == 2
        assert r.activation_bytes == pytest.approx(2 * per_micro)
        assert r.memory_bytes == pytest.approx(
            w.runtime_bytes + 16 * held + 4 * block + 2 * per_micro
        )
        assert r.describe() == (
            f"FSDP2 shard {k + 1}/{ranks} of h[0:2] h[4:6] + embedding + "
            f"{lay.head_label}"
        )
    # ranks with the extra row (tensor_split's first) are the largest
    assert a.largest_rank.rank == 0
    # B on one device is as before: its two blocks whole
    (b,) = p.loads["B"].ranks
    assert b.shard is None and b.blocks == B_BLOCKS and b.gathered_bytes == 0


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_the_ranks_shards_sum_to_the_partys_blocks(tiny, ranks):
    cfg, model, cut = tiny
    w = Workload(batch_size=ranks, micro_batch_size=ranks, seq_len=T)
    # Execute
    p = evaluate("tiny", cfg, cut, parties(f"A:1:{ranks}x1GB", f"B:1:{ranks}x1GB"), w)
    # Assert: the shards of every rank make up the blocks exactly, and
    # differ by at most R - 1 dim-0 rows of each parameter (chunks of
    # ceil(d0 / R), the last ranks short); the rest is on every rank
    for name, blocks in (("A", A_BLOCKS), ("B", B_BLOCKS)):
        ld = p.loads[name]
        assert ld.layout == ("sharded" if name == "A" or ranks > 2 else "pipeline")
        if ld.layout != "sharded":
            continue
        modules = [model.transformer.h[i] for i in blocks]
        whole = sum(numel(m) for m in modules)
        row = sum(p.numel() // p.shape[0] for m in modules for p in m.parameters())
        shards = [r.shard_params for r in ld.ranks]
        assert sum(shards) == whole
        assert 0 <= max(shards) - min(shards) <= (ranks - 1) * row
        assert sum(r.weights_bytes for r in ld.ranks) == 4 * (
            whole + ranks * (ld.params - whole)
        )


def test_a_compute_party_with_more_ranks_than_blocks_is_sharded(tiny):
    cfg, model, cut = tiny
    w = Workload(batch_size=8, micro_batch_size=4, seq_len=T)
    # Execute: B's 2 blocks on 4 devices (it raised before), and on 2
    p = evaluate("tiny", cfg, cut, parties("A:1:1GB", "B:4:4x1GB"), w)
    staged = evaluate("tiny", cfg, cut, parties("A:1:1GB", "B:4:2x1GB"), w)
    # Assert: 1/4 of each block per rank; its gradients accumulate whole
    b = p.loads["B"]
    whole = sum(numel(model.transformer.h[i]) for i in B_BLOCKS)
    assert b.layout == "sharded" and len(b.ranks) == 4
    for k, r in enumerate(b.ranks):
        shard = sum(chunk_numel(model.transformer.h[i], k, 4) for i in B_BLOCKS)
        assert r.params == r.shard_params == shard
        assert r.weights_bytes == 4 * shard and r.optimizer_bytes == 8 * shard
        assert r.grads_bytes == 4 * whole  # reduce-scattered in the last backward
        assert r.rows == 1 and r.head_pieces == ["", ""]
        assert r.describe() == f"FSDP2 shard {k + 1}/4 of h[2:4]"
    assert p.loads["B"].memory_bytes < staged.loads["B"].memory_bytes
    # up to one device per block it is pipeline stages, as before
    assert staged.loads["B"].layout == "pipeline"
    assert [r.blocks for r in staged.loads["B"].ranks] == [(2,), (3,)]
    assert all(r.shard is None for r in staged.loads["B"].ranks)


def test_sharded_ranks_need_a_row_each(tiny):
    cfg, _, cut = tiny
    w = Workload(batch_size=8, micro_batch_size=2, seq_len=T)
    # Execute / Assert: 3 ranks on micro-batches of 2 rows: one would idle
    with pytest.raises(PlanError, match="data party on 3 devices .* at least 3$"):
        evaluate("tiny", cfg, cut, parties("A:1:3x1GB", "B:1:1GB"), w)
    with pytest.raises(PlanError, match="or give B at most 2 devices"):
        evaluate("tiny", cfg, cut, parties("A:1:1GB", "B:1:3x1GB"), w)


def test_the_cut_search_uses_both_parties_device_sets(tiny):
    cfg, _, _ = tiny
    w = Workload(batch_size=4, micro_batch_size=2, seq_len=T)
    # A's largest rank on 2 devices at the cut the search picks unlimited
    free = plan("tiny", cfg, list(parties("A:1:2xinf", "B:4:3xinf").values()), w)
    # Execute: each device a byte less than A's one-device peak at that cut
    one = evaluate("tiny", cfg, free.partition, parties("A:1:1GB", "B:1:1GB"), w)
    limit = one.loads["A"].memory_bytes - 1
    spec = f"A:1:2x{limit:.0f}B"
    p = plan("tiny", cfg, list(parties(spec, "B:4:3xinf").values()), w)
    # Assert: A fits only because its ranks shard; B's ranks follow the cut
    assert p.loads["A"].layout == "sharded" and len(p.loads["A"].ranks) == 2
    assert p.loads["A"].memory_bytes <= limit
    assert len(p.loads["B"].ranks) == 3
    with pytest.raises(PlanError, match="fits the parties' memory"):
        plan("tiny", cfg, list(parties(f"A:1:{limit:.0f}B", "B:4:inf").values()), w)


def test_rank_bytes_of_the_data_party_is_what_the_plan_prints(tiny):
    from aisyn.train.memory import rank_bytes

    cfg, _, cut = tiny
    w = Workload(batch_size=6, micro_batch_size=3, seq_len=T, in_flight=2)
    # Execute
    p = evaluate("tiny", cfg, cut, parties("A:1:2x1GB", "B:1:1GB"), w)
    got = rank_bytes(cfg, cut, "A", 2, 3, T, 2, in_flight=2)
    # Assert
    assert got == [r.memory_bytes for r in p.loads["A"].ranks]
    assert got[0] > got[1]  # rank 0 runs 2 of the 3 rows
    with pytest.raises(PlanError, match="at least 4"):
        rank_bytes(cfg, cut, "A", 4, 3, T)


def test_cli_plan_names_the_sharded_ranks(capsys):
    from aisyn.cli import main

    # Execute
    main(
        ["split", "plan", "--model", "tiny", "--party", "A:1:2x1GB"]
        + ["--party", "B:4:1GB", "--batch-size", "4", "--micro-batch-size", "2"]
    )
    out = capsys.readouterr().out
    # Assert
    assert "A per rank (blocks FSDP2-sharded over 2 ranks" in out
    assert "  ranks 0–1 FSDP2 shards 1–2/2 of h[0:1] h[2:3] + embedding + ln_f" in out
    assert "gathered block " in out and "micro-batch(es) of 1 row(s)" in out
    assert "B per rank" not in out and "schedule" not in out


#: every rank of a fake process group (one process, no communication)
#: shards the real tiny model's A blocks with FSDP2 and reports what it keeps
FSDP2_SHARDS = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from aisyn.model.families import build_model, load_config

    ranks, blocks = int(sys.argv[1]), json.loads(sys.argv[2])
    cfg = load_config("tiny", num_layers=int(sys.argv[3]))
    out = []
    for k in range(ranks):
        dist.init_process_group("fake", store=FakeStore(), rank=k, world_size=ranks)
        model = build_model(cfg, seed=0)
        mesh = init_device_mesh("cpu", (ranks,))
        for i in blocks:
            fully_shard(model.get_submodule(cfg.layout.block_path(i)), mesh=mesh)
        local = 0
        whole = 0
        for p in model.parameters():
            if isinstance(p, DTensor):
                local += p.to_local().numel()
        for i in blocks:
            for p in model.get_submodule(cfg.layout.block_path(i)).parameters():
                whole += p.numel()
        out.append([local, whole])
        dist.destroy_process_group()
    print(json.dumps(out))
    """
)


@pytest.mark.heavy
def test_fsdp2_keeps_the_shards_the_planner_counts(tiny):
    cfg, _, cut = tiny
    ranks = 3  # hidden 128 and FFN 512 do not split evenly in 3
    w = Workload(batch_size=3, micro_batch_size=3, seq_len=T)
    p = evaluate("tiny", cfg, cut, parties(f"A:1:{ranks}x1GB", "B:1:1GB"), w)
    # Execute
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", FSDP2_SHARDS, str(ranks), json.dumps(A_BLOCKS)]
        + [str(CFG["num_layers"])],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    real = json.loads(done.stdout.strip().splitlines()[-1])
    # Assert: each rank's local shards are the planner's, and sum to the blocks
    assert [local for local, _ in real] == [r.shard_params for r in p.loads["A"].ranks]
    assert len({local for local, _ in real}) == 2  # uneven: the last rank less
    assert sum(local for local, _ in real) == real[0][1]

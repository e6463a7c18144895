"""A DiLoCo centre that sends a finite, wrong delta (issue 37, item 5): it is
left out of the outer step by name, no checkpoint keeps what it would have
made, a centre that keeps at it stops the run naming it, and the run resumes
from the last good checkpoint. And each centre's log lines carry its name
(item 12)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aisyn.net import free_port
from aisyn.train import checkpoint as ckpt
from aisyn.train.diloco.guard import HISTORY, DeltaGuard, consistent
from aisyn.train.run import read_metrics

# --- the rules, on reported numbers ---------------------------------------------


def stats(norms, cosines=None, ref_norm=1.0) -> torch.Tensor:
    """Rows of (squared norm, dot with the reference, squared reference norm)."""
    cosines = cosines or [math.nan] * len(norms)
    rows = []
    for n, c in zip(norms, cosines, strict=True):
        dot = 0.0 if math.isnan(c) else c * n * ref_norm
        ref_sq = 0.0 if math.isnan(c) else ref_norm**2
        rows.append([n * n, dot, ref_sq])
    return torch.tensor(rows, dtype=torch.float64)


def test_a_huge_delta_is_refused_at_the_first_outer_step_of_two_centres():
    guard = DeltaGuard(2, bound=4.0, min_cosine=-0.5)
    verdict = guard.judge(stats([1.0, 1e6]))
    assert verdict.accepted == [0]
    assert "1e+06x the other centres' median" in verdict.reasons[1]


def test_a_centre_that_sends_nothing_does_not_get_the_honest_one_refused():
    """With two centres "the others" is the liar: the honest centre, 1000x a
    near-zero delta that fell far below its own last one, is bounded by its
    own history instead, and kept; a huge one still is not."""
    guard = DeltaGuard(2, bound=4.0, min_cosine=-0.5)
    for _ in range(3):
        guard.record(guard.judge(stats([1.0, 1.1])))
    verdict = guard.judge(stats([1e-3, 1.0]))
    assert verdict.accepted == [0, 1]
    huge = guard.judge(stats([1e-3, 1e3]))
    assert huge.refused == [1] and "its own last accepted one (1.1)" in huge.reasons[1]


def test_a_scaled_or_sign_flipped_delta_is_refused_once_there_is_history():
    guard = DeltaGuard(2, bound=4.0, min_cosine=-0.5)
    for _ in range(3):
        guard.record(guard.judge(stats([1.0, 1.2], [0.6, 0.5])))
    ten = guard.judge(stats([1.0, 12.0], [0.6, 0.5]))
    assert ten.refused == [1] and "12x the other centres' median" in ten.reasons[1]
    flipped = guard.judge(stats([1.0, 1.2], [0.6, -0.6]))
    assert flipped.refused == [1] and "cosine -0.600" in flipped.reasons[1]


def test_every_centre_growing_alike_in_warm_up_is_kept():
    """Warm-up grows every centre's delta step after step (3x from the first
    outer step to the second with a linear warm-up over two): no refusal."""
    guard = DeltaGuard(4, bound=4.0, min_cosine=-0.5)
    for k in range(8):
        scale = 2 * k + 1  # a linear warm-up: the mean lr of outer step k
        verdict = guard.judge(stats([scale * x for x in (1.0, 1.3, 0.8, 1.1)]))
        assert verdict.refused == []
        guard.record(verdict)
    assert guard.history.shape == (4, HISTORY) and (guard.history > 0).all()


def test_a_non_finite_delta_is_refused_and_one_centre_is_not_bounded():
    guard = DeltaGuard(3, bound=4.0, min_cosine=-0.5)
    assert guard.judge(stats([1.0, math.inf, 1.0])).refused == [1]
    alone = DeltaGuard(1, bound=4.0, min_cosine=-0.5)
    alone.record(alone.judge(stats([1.0])))
    assert alone.judge(stats([1e6])).refused == []  # the whole run: no one to lie to


def test_a_delta_other_than_reported_is_inconsistent():
    assert consistent((1.0, 0.5), (1.0, 0.5), 1.0, 1e-3)
    assert consistent((0.5, 0.2), (1.0, 0.2), 1.0, 1e-3)  # shorter: harmless
    assert not consistent((1e3, 0.5), (1.0, 0.5), 1.0, 1e-3)
    assert not consistent((1.0, -0.5), (1.0, 0.5), 1.0, 1e-3)
    assert not consistent((math.nan, 0.0), (1.0, 0.0), 1.0, 1e-3)


# --- two centres, one of them lying -----------------------------------------------

#: ``aisyn`` as a centre whose outer deltas are ``scale`` x its real ones at
#: outer steps ``first``..``last`` (argv: scale liar first last, then aisyn's)
_LYING_CENTRE = """
import sys
from aisyn.train import diloco
scale, liar, first, last = float(sys.argv[1]), *map(int, sys.argv[2:5])
sys.argv = ["aisyn", *sys.argv[5:]]
real_start = diloco.OuterSync.start
def start(self):
    if self.centres.rank != liar or not first <= self.steps + 1 <= last:
        return real_start(self)
    g, real_local = self.global_flat.detach(), diloco.OuterSync.local_flat
    self.local_flat = lambda: g - scale * (g - real_local(self))
    try:
        return real_start(self)
    finally:
        del self.local_flat
diloco.OuterSync.start = start
from aisyn.cli import console
console()
"""


def run_centres(args: list[str], tmp_path: Path, lie: tuple, tag: str):
    """Two centres of ``aisyn train ARGS`` (centre 1 lying as ``lie`` says:
    scale, first and last outer step); (return codes, logs)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    scale, first, last = lie
    logs = [tmp_path / f"{tag}{r}.log" for r in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _LYING_CENTRE,
                str(scale),
                "1",
                str(first),
                str(last),
                "train",
                *args,
            ],
            env={**env, "RANK": str(r)},
            stdout=logs[r].open("w"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for r in range(2)
    ]
    try:
        rcs = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return rcs, [log.read_text() for log in logs]


def args(model_file, data, out: Path, steps: int, *more) -> list[str]:
    return [
        "--model", str(model_file), "--data", str(data), "--out", str(out),
        "--batch-size", "4", "--lr", "3e-3", "--warmup", "1", "--log-every",
        "4", "--seed", "3", "--sync", "diloco", "--sync-timeout", "60",
        "--steps", str(steps), "--inner-steps", "4", "--ckpt-every", "4", *more,
    ]  # fmt: skip


def largest_weight(run: Path) -> float:
    """The largest |w| over every checkpoint the run kept (its last two)."""
    return max(
        max(
            float(t.abs().max())
            for t in ckpt.read_tensors(f / ckpt.MODEL_FILE).values()
        )
        for f in sorted((run / "checkpoints").iterdir())
        if (f / ckpt.MODEL_FILE).is_file()
    )


@pytest.mark.heavy
def test_a_centre_sending_a_huge_or_flipped_delta_is_left_out_by_name(
    tmp_path, news_data, model_file
):
    """Centre 1 sends 10^6 x its delta at the second outer step (one run)
    and -10 x it at the fourth (another): each time every centre leaves it
    out, naming it (never --lr), applies centre 0's alone, and the run ends
    with finite, ordinary weights in the checkpoint right after it and the
    last (today both are applied: the weights blow up, the checkpoint keeps
    them, and the run dies of NaN)."""
    out = tmp_path / "run"
    rcs, logs = run_centres(
        args(model_file, news_data, out, 12), tmp_path, (1e6, 2, 2), "a"
    )
    assert rcs == [0, 0], logs
    # and the -10x on a run that has a history to bound it against
    out2 = tmp_path / "run2"
    rcs2, logs2 = run_centres(
        args(model_file, news_data, out2, 16), tmp_path, (-10.0, 4, 4), "b"
    )
    assert rcs2 == [0, 0], logs2
    for log, step in ((logs[0], 2), (logs[1], 2), (logs2[0], 4), (logs2[1], 4)):
        assert f"outer step {step}: centre 1's delta left out: its delta" in log
        assert "--lr" not in log
    assert "-delta-bound 4" in logs[0] and "-delta-bound 4" in logs2[0]
    records = [r for r in read_metrics(out / "metrics.jsonl") if "outer_step" in r]
    assert [r.get("outer_refused") for r in records] == [None, [1], None]
    for run in (out, out2, out / "centres" / "1", out2 / "centres" / "1"):
        assert largest_weight(run) < 2.0  # the model's own scale (about 1)
    final = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert math.isfinite(final[-1]) and final[-1] < final[0]


@pytest.mark.heavy
def test_a_centre_that_keeps_lying_stops_the_run_by_name_and_it_resumes(
    tmp_path, news_data, model_file
):
    """Centre 1 sends 10^6 x its delta from the second outer step on: left
    out three times in a row, the run stops on both centres with one line
    naming centre 1 (not --lr) before the fourth outer step's checkpoint;
    every kept checkpoint holds a good model, and the centres resume from
    the last one (centre 1 honest again) to the end."""
    out = tmp_path / "run"
    rcs, logs = run_centres(
        args(model_file, news_data, out, 16), tmp_path, (1e6, 2, 99), "a"
    )
    assert rcs == [2, 2], logs
    for log in logs:
        errors = [x for x in log.splitlines() if x.startswith("aisyn: error:")]
        assert len(errors) == 1, log
        assert errors[0].startswith(
            "aisyn: error: centre 1's delta was out of bound at 3 outer steps in a row"
        )
        assert "--lr" not in errors[0] and "Traceback" not in log
    assert ckpt.complete_steps(out / "checkpoints") == [8, 12]
    assert largest_weight(out) < 2.0 and largest_weight(out / "centres" / "1") < 2.0
    rcs, logs = run_centres(
        args(model_file, news_data, out, 16, "--resume"), tmp_path, (1.0, 0, 0), "b"
    )
    assert rcs == [0, 0], logs
    assert "resumed from" in logs[0] and "(step 12)" in logs[0]
    assert ckpt.complete_steps(out / "checkpoints")[-1] == 16
    assert largest_weight(out) < 2.0


@pytest.mark.heavy
def test_each_centres_log_lines_carry_its_name(tmp_path, news_data, model_file):
    """Two centres logging to one terminal: every line a centre logs starts
    with its centre (``centre 1: epoch 0 step 4/8 loss: ...``)."""
    out = tmp_path / "run"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    train = args(model_file, news_data, out, 8)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "aisyn.cli", "train", "--quiet", *train],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert [p.returncode for p in procs] == [0, 0], logs
    for c, log in enumerate(logs):
        lines = [x for x in log.splitlines() if x.startswith(("INFO:", "WARNING:"))]
        assert any(f"centre {c}: epoch 0 step 4/8 loss: " in x for x in lines), log
        for line in lines:
            assert line.split(":", 2)[2].startswith(f"centre {c}: "), line


@pytest.mark.parametrize("per", [1, 2])
def test_the_label_names_the_rank_in_a_centre_of_several(per):
    from aisyn.train.diloco import centre_label

    assert centre_label(3, per) == ("centre 3" if per == 1 else "centre 1 (rank 3)")


#: two centres (``python -c``): centre 1 moves by 1000x centre 0 and reports
#: the numbers of a delta 1000x smaller; rank 0 writes each precision's record
_MISREPORTING = """
import json, logging, sys, torch, torch.distributed as dist
from aisyn.train.diloco import DiLoCoConfig, OuterSync, topology
from aisyn.train.distributed import DistContext
logging.basicConfig(level=logging.WARNING, format="%(message)s")
out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
where = topology(DistContext(rank, 2), 1)
seen = {}
for precision in ("fp32", "int8"):
    p = torch.nn.Parameter(torch.zeros(5000))
    sync = OuterSync([p], DiLoCoConfig(precision=precision), where.across)
    move = torch.linspace(0.5, 1.5, 5000) * (1000.0 if rank == 1 else 1.0)
    with torch.no_grad():
        p.sub_(0.01 * move)
    if rank == 1:  # reports the numbers of the delta it would have had
        sync.screen = lambda d, ref: OuterSync.screen(sync, d / 1000, ref)
    record = sync.step()
    seen[precision] = {"record": record, "p": p.detach()[:3].tolist()}
if rank == 0:
    open(out, "w").write(json.dumps(seen))
dist.destroy_process_group()
from aisyn.procs import exit_rank
exit_rank(0)
"""


@pytest.mark.heavy
def test_a_centre_that_sends_another_delta_than_it_reports_is_caught(tmp_path):
    """The numbers a centre reports are checked against what arrives: an
    int8 delta (every centre receives every centre's) 1000x the reported
    one is left out by name and the other's applied; an fp32 one (summed on
    the way) makes the sum longer than the reports allow: the outer step is
    skipped, naming the other centre (of two, each can tell)."""
    port, out = free_port(), tmp_path / "seen.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _MISREPORTING, str(out)],
            env={**env, "RANK": str(r)},
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    try:
        logs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert [p.returncode for p in procs] == [0, 0], logs
    import json

    seen = json.loads(out.read_text())
    int8, fp32 = seen["int8"], seen["fp32"]
    assert (
        int8["record"]["outer_refused"] == [1] and "outer_skipped" not in int8["record"]
    )
    # centre 0's own delta alone: 0.01 * move, then the Nesterov step (x 0.7 x 1.9)
    own = 0.01 * torch.linspace(0.5, 1.5, 5000)[:3]
    torch.testing.assert_close(
        torch.tensor(int8["p"]), -0.7 * 1.9 * own, rtol=2e-2, atol=1e-5
    )
    assert "centre 1's delta left out: it is not the delta it reported" in logs[0]
    assert fp32["record"]["outer_skipped"] and fp32["p"] == [0.0, 0.0, 0.0]
    assert "centre 1 sends a delta other than the one it reports" in logs[0]

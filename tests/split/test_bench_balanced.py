"""bench/split_efficiency.py's balanced section: the depth and cut it measures
pipelining at, and the schedule's own bound it prints beside the floor (its
timings are not checked here -- timing never is in tests)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest

from aisyn.model.families import load_config
from aisyn.model.memory import Workload
from aisyn.split import schedule
from aisyn.split.planner import PartySpec, plan
from aisyn.train.config import TrainConfig

BENCH = Path(__file__).resolve().parents[2] / "bench" / "split_efficiency.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("split_efficiency", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_the_balanced_model_is_the_shallowest_with_a_floor_of_at_most_0p56(bench):
    small = load_config("small")  # 6 layers: the planner's best floor is 0.636
    tcfg = TrainConfig(batch_size=8, micro_batch_size=1)
    # Execute
    deep, cut, floor = bench.balanced_cut("small", small, tcfg, window=2)
    # Assert: the planner's own cut for --pipeline 2 on two equal parties
    equal = [PartySpec("A", 1.0, math.inf), PartySpec("B", 1.0, math.inf)]
    work = Workload(8, 1, seq_len=small.seq_len, in_flight=3)
    chosen = plan("small", deep, equal, work)
    assert cut == chosen.partition
    assert floor == pytest.approx(chosen.pipelined_time / chosen.lockstep_time)
    assert floor <= bench.BALANCED_FLOOR
    shallower = dataclasses.replace(small, num_layers=deep.num_layers - 1)
    less = plan("small", shallower, equal, work)
    assert less.pipelined_time / less.lockstep_time > bench.BALANCED_FLOOR
    assert deep.num_layers == 8  # u:1,1 of 8 layers: A 51.1 %, B 48.9 %


def test_the_schedule_bound_is_the_floor_plus_fill_and_drain(bench):
    cfg = dataclasses.replace(load_config("small"), num_layers=8)
    deep, cut, floor = bench.balanced_cut("small", cfg, TrainConfig(), window=2)
    # Execute
    bounds = [bench.schedule_bound(deep, cut, m, 2) for m in (8, 16, 64)]
    # Assert: above the floor, and closer to it the more micro-batches fill
    # the pipeline
    assert floor < bounds[2] < bounds[1] < bounds[0]
    assert bounds[2] / floor < 1.02 and bounds[0] / floor > 1.08


def test_makespan_of_lockstep_is_every_op_in_turn(bench):
    cost = {"a": {"F": 1.0, "L": 5.0, "B": 2.0}, "b": {"F": 3.0, "B": 6.0}}
    # Execute / Assert: lockstep leaves one party idle while the other works
    assert bench.makespan(schedule.lockstep(4), cost) == 4 * 17.0
    # pipelined: A's 8 a micro-batch, less than both in turn
    piped = bench.makespan(schedule.pipelined(4, 2), cost)
    assert 4 * 9.0 <= piped < 4 * 17.0

"""Flower messages without Flower's runtime: a fake grid, task identity and replies.

Strategies are driven the way ``Strategy.start`` drives them (``configure_train``
then ``aggregate_train``), with replies built by hand, so a test can say exactly
what each client sends.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from aisyn.fl.records import REPLY_METRICS


@pytest.fixture
def task_identity() -> Iterator[None]:
    """Flower stamps messages with the identity of the running task; fake one."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class FakeGrid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return self.nodes


def record(arrays: dict) -> ArrayRecord:
    return ArrayRecord(
        {k: Array(np.asarray(v, dtype=np.float32)) for k, v in arrays.items()}
    )


def metrics(n, **kw) -> MetricRecord:
    m = {k: 1.0 for k in REPLY_METRICS}
    m["num-examples"] = n
    m.update(kw)
    return MetricRecord(m)


def reply_to(msg: Message, arrays: dict, n, **kw) -> Message:
    return Message(
        RecordDict({"arrays": record(arrays), "metrics": metrics(n, **kw)}),
        reply_to=msg,
    )


def configured(strategy, global_arrays: dict, nodes=(1, 2), server_round: int = 1):
    """Send round ``server_round``; returns the messages by destination node."""
    msgs = strategy.configure_train(
        server_round, record(global_arrays), ConfigRecord(), FakeGrid(list(nodes))
    )
    return {m.metadata.dst_node_id: m for m in msgs}

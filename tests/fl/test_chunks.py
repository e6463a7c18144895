"""Chunked updates (aisyn.fl.chunks): the plan, the exchange, and lying clients.

The exchange runs the real ``ChunkedGrid`` and the real client handlers
(``stage_global``, ``save_update``, ``update_chunk``) in-process over a grid
that routes each message to its client, and the real guarded strategy
aggregates: the result must be the unchunked round's, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from flower_fakes import FakeGrid, configured, metrics, record, reply_to
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType

from aisyn.fl import chunked_grid, chunks
from aisyn.fl.records import UpdateRejected, payload_bytes
from aisyn.fl.settings import FLSettings
from aisyn.fl.strategy import guard_of, make_strategy

pytestmark = pytest.mark.usefixtures("task_identity")

LIMIT = 16 * 1024
SPEC = {
    "wte": (300, 24),  # 28.8 kB: split along its rows
    "ln.bias": (24,),
    "ln.weight": (24,),
    "mlp": (24, 96),  # 9.2 kB
    "head": (3, 4, 5),
    "proj": (96, 24),
}


def global_model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SPEC.items()}


def trained(g: dict, node: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + node)
    return {
        k: (v + 0.01 * rng.normal(size=v.shape)).astype(np.float32)
        for k, v in g.items()
    }


def settings(**kw) -> FLSettings:
    base = dict(min_clients=3, max_norm_ratio=0, max_message_mb=LIMIT / chunks.MiB)
    return FLSettings.from_dict(base | kw)


def test_plan_covers_every_tensor_once_under_the_limit():
    plan = chunks.plan_chunks(SPEC, LIMIT)
    assert len(plan) >= 3
    g = global_model()
    covered = {n: np.zeros(s[0] if s else 1, int) for n, s in SPEC.items()}
    for chunk in plan:
        assert payload_bytes(chunks.chunk_arrays(g, chunk)) <= LIMIT
        for p in chunk:
            if p.start is None:
                covered[p.name] += 1
            else:
                covered[p.name][p.start : p.stop] += 1
    assert all((c == 1).all() for c in covered.values())
    assert any(p.start is not None for c in plan for p in c)  # wte was split
    parts = [{k: v.numpy() for k, v in chunks.chunk_arrays(g, c).items()} for c in plan]
    back = chunks.assemble(SPEC, plan, parts)
    assert all(np.array_equal(back[k], g[k]) for k in g)
    assert chunks.plan_chunks(dict(reversed(list(SPEC.items()))), LIMIT) == plan


def test_a_row_larger_than_the_limit_is_one_clear_line():
    with pytest.raises(ValueError, match=r"^wide: one row .* raise max-message-mb$"):
        chunks.plan_chunks({"wide": (2, 5000)}, LIMIT)


def test_combinations_that_cannot_run_chunked_are_refused():
    spec = {"w": (4096, 8)}
    for kw, name in [
        (dict(secure_aggregation=True, min_clients=2), "secure aggregation"),
        (dict(dp="client", min_clients=2), "client DP"),
        (dict(aggregation="krum", min_clients=5), "krum"),
        (dict(strategy="fedadam", min_clients=2), "fedadam"),
    ]:
        with pytest.raises(ValueError, match=name):
            chunks.plan_for(settings(**kw), spec)
    assert chunks.plan_for(settings(max_message_mb=1.0), spec) is None  # fits one
    assert chunks.plan_for(settings(max_message_mb=0), spec) is None
    with pytest.raises(ValueError, match="max-message-mb must be 0"):
        settings(max_message_mb=0.001)


class RoutingGrid(FakeGrid):
    """Delivers each message to its client's handler, in-process."""

    def __init__(self, clients: dict):
        super().__init__(sorted(clients))
        self.clients = clients
        self.sent: list[int] = []

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(
            content,
            dst_node_id=dst_node_id,
            message_type=message_type,
            group_id=group_id,
        )

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for m in messages:
            self.sent.append(payload_bytes_of(m))
            reply = self.clients[m.metadata.dst_node_id](m)
            if reply is not None:
                replies.append(reply)
        return replies


def payload_bytes_of(m: Message) -> int:
    return sum(payload_bytes(r) for r in m.content.array_records.values())


class Client:
    """An honest client: stages the global chunks, checks the assembled model,
    sends ``trained(global, node)`` chunk by chunk."""

    def __init__(self, node: int, out, n: int = 10):
        self.node, self.out, self.n = node, out, n

    def __call__(self, m: Message) -> Message | None:
        kind = m.metadata.message_type
        if kind == chunks.GLOBAL_CHUNK:
            chunks.stage_global(self.out, 7, m.content)
            return Message(RecordDict({"metrics": MetricRecord({"ok": 1})}), reply_to=m)
        if kind == MessageType.TRAIN:
            config = m.content["config"]
            r = int(config["server-round"])
            plan = chunks.plan_chunks(SPEC, LIMIT)
            g = chunks.load_staged_global(
                self.out, 7, r, SPEC, plan, int(config[chunks.COUNT_KEY])
            )
            self.received = g
            chunks.save_update(self.out, 7, r, trained(g, self.node))
            return Message(RecordDict({"metrics": metrics(self.n)}), reply_to=m)
        assert kind == chunks.UPDATE_CHUNK
        return self.chunk(m, chunks.update_chunk(self.out, 7, m.content["chunk"]))

    def chunk(self, m: Message, content: RecordDict) -> Message | None:
        return Message(content, reply_to=m)


def unchunked(aggregation: str, nodes, g, weights) -> dict[str, np.ndarray]:
    s = settings(aggregation=aggregation, max_message_mb=0, min_clients=len(nodes))
    strategy = make_strategy(s)
    msgs = configured(strategy, g, nodes)
    replies = [reply_to(msgs[n], trained(g, n), weights[n]) for n in nodes]
    arrays, _ = strategy.aggregate_train(1, replies)
    return {k: a.numpy() for k, a in arrays.items()}


def chunked_round(aggregation: str, clients: dict, g, server_round: int = 1):
    s = settings(aggregation=aggregation, min_clients=len(clients))
    strategy = make_strategy(s)
    guard = guard_of(strategy)
    grid = RoutingGrid(clients)
    plan = chunks.plan_for(s, SPEC)
    out = clients[min(clients)].out.parent / "server"
    guard.chunked = chunked_grid.ChunkedGrid(grid, SPEC, plan, LIMIT, out)
    msgs = strategy.configure_train(
        server_round, record(g), ConfigRecord(), guard.chunked
    )
    replies = guard.chunked.send_and_receive(msgs, timeout=60)
    arrays, _ = strategy.aggregate_train(server_round, replies)
    assert max(grid.sent) <= LIMIT  # every message, both ways, under the limit
    assert not any(out.iterdir())  # the spilled updates are gone
    result = None if arrays is None else {k: a.numpy() for k, a in arrays.items()}
    return result, guard.round_log[server_round], plan


@pytest.mark.parametrize("aggregation", ["mean", "median", "trimmed-mean"])
def test_chunked_aggregate_is_the_unchunked_one_bit_for_bit(tmp_path, aggregation):
    n = 5 if aggregation == "trimmed-mean" else 3
    weights = {i: 10 * i for i in range(1, n + 1)}
    g = global_model()
    clients = {i: Client(i, tmp_path / f"c{i}", weights[i]) for i in weights}
    got, entry, plan = chunked_round(aggregation, clients, g)
    want = unchunked(aggregation, list(weights), g, weights)
    assert entry["accepted"] == n and entry["chunks"] == len(plan) > 2
    for k in SPEC:
        assert np.array_equal(got[k], want[k]), k  # same float64 ops per coordinate
    for c in clients.values():  # the clients assembled the global model exactly
        assert all(np.array_equal(c.received[k], g[k]) for k in SPEC)


def _retag(content: RecordDict, **meta) -> RecordDict:
    old = dict(content[chunks.CHUNK_META])
    return RecordDict(
        {"arrays": content["arrays"], chunks.CHUNK_META: ConfigRecord(old | meta)}
    )


def _edit(content: RecordDict, edit) -> RecordDict:
    arrays = {k: a.numpy().copy() for k, a in content["arrays"].items()}
    edit(arrays)
    return RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            chunks.CHUNK_META: content[chunks.CHUNK_META],
        }
    )


def _rename(arrays):
    key = next(iter(arrays))
    arrays["not.in.model"] = arrays.pop(key)


def _reshape(arrays):
    key = next(iter(arrays))
    arrays[key] = arrays[key].reshape(-1)[:-1]


def _nan(arrays):
    arrays[next(iter(arrays))].flat[3] = np.nan


class Liar(Client):
    """Valid credentials, honest until update chunk 1 (``lie``)."""

    def __init__(self, node, out, lie, n=10):
        super().__init__(node, out, n)
        self.lie = lie
        self.first: RecordDict | None = None

    def chunk(self, m, content):
        index = content[chunks.CHUNK_META]["index"]
        if index == 0:
            self.first = content
        if index != 1:
            return Message(content, reply_to=m)
        lied = self.lie(self, content)
        return None if lied is None else Message(lied, reply_to=m)


LIES = {
    "missing": (lambda c, content: None, "chunk 1: no reply in time"),
    "repeated": (lambda c, content: c.first, "chunk 0 repeated"),
    "other round": (
        lambda c, content: _retag(content, round=2),
        "of round 2 in round 1",
    ),
    "unknown tensor": (
        lambda c, content: _edit(content, _rename),
        "chunk 1: tensor names differ",
    ),
    "wrong shape": (lambda c, content: _edit(content, _reshape), "chunk 1: .*expected"),
    "non-finite": (lambda c, content: _edit(content, _nan), "non-finite values"),
    "count": (lambda c, content: _retag(content, count=99), "says 99 chunks"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_lying_client_is_rejected_and_the_aggregate_is_the_honest_ones(
    tmp_path, lie, caplog
):
    how, reason = LIES[lie]
    g = global_model()
    weights = {1: 10, 2: 20, 3: 30}
    clients = {
        1: Client(1, tmp_path / "c1", 10),
        2: Client(2, tmp_path / "c2", 20),
        3: Liar(3, tmp_path / "c3", how, 30),
    }
    got, entry, _ = chunked_round("mean", clients, g)
    assert [r["node"] for r in entry["rejected"]] == [3]
    import re

    assert re.search(reason, entry["rejected"][0]["reason"]), entry["rejected"]
    assert "\n" not in entry["rejected"][0]["reason"]
    want = unchunked("mean", [1, 2], g, weights)
    assert all(np.array_equal(got[k], want[k]) for k in SPEC)


def test_receiver_refuses_an_oversized_chunk_before_decoding():
    plan = chunks.plan_chunks(SPEC, LIMIT)
    rx = chunks.ChunkReceiver(SPEC, plan, 1, LIMIT // 4)
    g = global_model()
    content = RecordDict(
        {
            "arrays": chunks.chunk_arrays(g, plan[0]),
            chunks.CHUNK_META: chunks.chunk_meta(1, 0, len(plan), LIMIT),
        }
    )
    with pytest.raises(UpdateRejected, match=r"chunk 0: \d+ bytes, over the"):
        rx.accept(content)
    with pytest.raises(UpdateRejected, match=r"missing chunk\(s\) \[0, 1"):
        rx.check_complete()


def test_a_client_refuses_a_repeated_or_missing_global_chunk(tmp_path):
    plan = chunks.plan_chunks(SPEC, LIMIT)
    g = global_model()

    def content(i, r=1):
        return RecordDict(
            {
                "arrays": chunks.chunk_arrays(g, plan[i]),
                chunks.CHUNK_META: chunks.chunk_meta(r, i, len(plan), LIMIT),
            }
        )

    chunks.stage_global(tmp_path, 7, content(0))
    with pytest.raises(ValueError, match="global chunk 0 of round 1 repeated"):
        chunks.stage_global(tmp_path, 7, content(0))
    with pytest.raises(ValueError, match="global chunk 1 of .* never arrived"):
        chunks.load_staged_global(tmp_path, 7, 1, SPEC, plan, len(plan))
    # a new round's first chunk clears the last round's staging
    chunks.stage_global(tmp_path, 7, content(0, r=2))
    assert [p.name for p in (tmp_path / chunks.STAGING).iterdir()] == ["run7-round2"]


class FailingTrainer(Client):
    """Its training fails (a rank died): the train reply is an error."""

    def __call__(self, m):
        if m.metadata.message_type == MessageType.TRAIN:
            from flwr.app import Error

            return Message(Error(0, "client c3: a training rank failed"), reply_to=m)
        return super().__call__(m)


def test_a_client_whose_training_fails_is_left_out_of_a_chunked_round(tmp_path):
    g = global_model()
    weights = {1: 10, 2: 20, 3: 30}
    clients = {i: Client(i, tmp_path / f"c{i}", weights[i]) for i in (1, 2)}
    clients[3] = FailingTrainer(3, tmp_path / "c3", 30)
    got, entry, _ = chunked_round("mean", clients, g)
    assert entry["rejected"] == [
        {"node": 3, "reason": "client failed: client c3: a training rank failed"}
    ]
    want = unchunked("mean", [1, 2], g, weights)
    assert all(np.array_equal(got[k], want[k]) for k in SPEC)


def test_a_second_round_clears_the_first_rounds_staging(tmp_path):
    g = global_model()
    clients = {i: Client(i, tmp_path / f"c{i}", 10 * i) for i in (1, 2, 3)}
    first, _, _ = chunked_round("mean", clients, g, server_round=1)
    second, entry, _ = chunked_round("mean", clients, first, server_round=2)
    assert entry["accepted"] == 3
    assert all(
        np.array_equal(c.received[k], first[k]) for c in clients.values() for k in SPEC
    )
    staged = {
        p.name for c in clients.values() for p in (c.out / chunks.STAGING).iterdir()
    }
    assert staged == {"run7-round2"}  # round 1's global chunks and update are gone

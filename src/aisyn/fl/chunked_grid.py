"""The server's side of a chunked round (``fl.chunks``): ``ChunkedGrid`` sends
the global model chunk by chunk to every sampled node, pulls each node's
update chunk by chunk, checks every chunk (``chunks.ChunkReceiver``) and
spills it to a file of its own, so that the server never holds every
client's whole update at once.
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.serverapp import Grid

from aisyn.fl.chunks import (
    CHUNK_META,
    COUNT_KEY,
    GLOBAL_CHUNK,
    UPDATE_CHUNK,
    ChunkReceiver,
    Plan,
    chunk_arrays,
    chunk_meta,
    load_arrays,
    save_arrays,
)
from aisyn.fl.records import UpdateRejected
from aisyn.fl.wrapped_grid import WrappedGrid

log = logging.getLogger("aisyn.fl.chunks")


@dataclass
class NodeUpdate:
    """What the server kept of one node's chunked update: where it spilled it,
    its distance to the global model, or why it was rejected."""

    folder: Path
    sqdist: float = 0.0
    problem: str | None = None
    bytes: int = 0

    @property
    def norm(self) -> float:
        return math.sqrt(self.sqdist)

    def chunk(self, index: int) -> dict[str, np.ndarray]:
        return load_arrays(self.folder / f"chunk-{index}.safetensors")


class ChunkedGrid(WrappedGrid):
    """The Grid a chunked run's strategy sees: a train or evaluate message's
    global model goes out chunk by chunk, and a train reply's update is pulled
    chunk by chunk into ``updates`` (checked, spilled to ``spill``); everything
    else passes through to ``grid``."""

    def __init__(
        self,
        grid: Grid,
        spec: dict[str, tuple[int, ...]],
        plan: Plan,
        limit: int,
        spill: Path,
    ) -> None:
        super().__init__(grid)
        self.spec, self.plan, self.limit = spec, plan, limit
        self.spill = spill
        self.updates: dict[int, NodeUpdate] = {}
        self.global_arrays: dict[str, np.ndarray] = {}

    def handles(self, messages: list[Message]) -> bool:
        return not _kinds(messages) - {MessageType.TRAIN, MessageType.EVALUATE}

    def exchange(self, messages: list[Message], timeout: float | None) -> list[Message]:
        # Flower's strategies put the round in the config (and leave group_id)
        server_round = int(messages[0].content["config"]["server-round"])
        arrays: ArrayRecord = messages[0].content["arrays"]  # type: ignore[assignment]
        global_arrays = {k: a.numpy() for k, a in arrays.items()}
        # each exchange (a chunk to or from every node) waits at most timeout
        nodes = self._send_global(messages, global_arrays, server_round, timeout)
        out = []
        for m in messages:
            if m.metadata.dst_node_id not in nodes:
                continue
            config = ConfigRecord(
                {**dict(m.content["config"]), COUNT_KEY: len(self.plan)}
            )
            out.append(
                _message(
                    RecordDict({"config": config}),
                    m.metadata.message_type,
                    m.metadata.dst_node_id,
                    m.metadata.group_id,
                )
            )
        replies = list(self.grid.send_and_receive(out, timeout=timeout))
        if _kinds(messages) == {MessageType.TRAIN}:
            self.global_arrays = global_arrays
            self._pull_updates(replies, server_round, timeout)
        return replies

    def _send_global(
        self,
        messages: list[Message],
        global_arrays: dict[str, np.ndarray],
        server_round: int,
        timeout: float | None,
    ) -> set[int]:
        """Every chunk to every node; returns the nodes that staged them all."""
        nodes = {m.metadata.dst_node_id for m in messages}
        group = str(server_round)
        for i, chunk in enumerate(self.plan):
            content = RecordDict(
                {
                    "arrays": chunk_arrays(global_arrays, chunk),
                    CHUNK_META: chunk_meta(server_round, i, len(self.plan), self.limit),
                }
            )
            out = [_message(content, GLOBAL_CHUNK, n, group) for n in sorted(nodes)]
            ok = set()
            for reply in self.grid.send_and_receive(out, timeout=timeout):
                node = reply.metadata.src_node_id
                if reply.has_error():
                    log.warning(
                        "round %d: node %s failed global chunk %d: %s",
                        server_round,
                        node,
                        i,
                        reply.error.reason,
                    )
                else:
                    ok.add(node)
            for node in nodes - ok:
                log.warning(
                    "round %d: node %s did not stage global chunk %d; left out",
                    server_round,
                    node,
                    i,
                )
            nodes = ok
        return nodes

    def _pull_updates(
        self, replies: list[Message], server_round: int, timeout: float | None
    ) -> None:
        for old in self.updates.values():
            shutil.rmtree(old.folder, ignore_errors=True)
        self.updates = {}
        receivers = {}
        group = str(server_round)
        for reply in replies:
            if reply.has_error():
                continue
            node = reply.metadata.src_node_id
            folder = self.spill / f"round{server_round}-node{node}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True, mode=0o700)
            self.updates[node] = NodeUpdate(folder)
            receivers[node] = ChunkReceiver(
                self.spec, self.plan, server_round, self.limit
            )
        for i in range(len(self.plan)):
            live = sorted(n for n, u in self.updates.items() if u.problem is None)
            if not live:
                break
            request = ConfigRecord(
                {"round": server_round, "index": i, "limit": self.limit}
            )
            out = [
                _message(RecordDict({CHUNK_META: request}), UPDATE_CHUNK, n, group)
                for n in live
            ]
            answered = set()
            for reply in self.grid.send_and_receive(out, timeout=timeout):
                node = reply.metadata.src_node_id
                update = self.updates.get(node)
                if update is None or update.problem is not None or node in answered:
                    continue
                answered.add(node)
                if reply.has_error():
                    update.problem = f"chunk {i}: client failed: {reply.error.reason}"
                    continue
                try:
                    index, arrays = receivers[node].accept(reply.content)
                except UpdateRejected as e:
                    update.problem = str(e)
                    continue
                self._keep(update, index, arrays)
            for node in set(live) - answered:
                self.updates[node].problem = f"chunk {i}: no reply in time"
        for node, update in self.updates.items():
            if update.problem is None:
                try:
                    receivers[node].check_complete()
                except UpdateRejected as e:
                    update.problem = str(e)
            if update.problem is not None:
                shutil.rmtree(update.folder, ignore_errors=True)

    def _keep(self, update: NodeUpdate, index: int, arrays: dict) -> None:
        for p in self.plan[index]:
            base = p.take(self.global_arrays[p.name]).astype(np.float64)
            update.sqdist += float(np.square(arrays[p.key] - base).sum())
            update.bytes += arrays[p.key].nbytes
        save_arrays(update.folder / f"chunk-{index}.safetensors", arrays)

    def clear(self) -> None:
        for update in self.updates.values():
            shutil.rmtree(update.folder, ignore_errors=True)
        self.updates = {}


def _kinds(messages: list[Message]) -> set[str]:
    return {m.metadata.message_type for m in messages}


def _message(content: RecordDict, kind: str, node: int, group: str) -> Message:
    return Message(content, dst_node_id=node, message_type=kind, group_id=group)

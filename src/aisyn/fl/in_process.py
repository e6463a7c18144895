"""Flower's ``Grid`` with every client in this process.

Each message is answered by the real ClientApp (``fl.client_app.app``), one
client after another, so a federation run over it is deterministic on CPU:
what benchmarks use to compare aggregations, and tests to check that a
resumed server ends where an uninterrupted one ends. ``answer`` may replace
a reply (a benchmark's attacker) after the ClientApp built it: the shipped
client has no hook of its own.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid

from aisyn.fl import client, client_app

#: the run ID the messages carry (Flower stamps the running task's)
RUN_ID = 1


class InProcessGrid(Grid):
    """``nodes``: node ID -> the node config a SuperNode would have (name,
    data, base, out)."""

    def __init__(
        self,
        nodes: dict[int, dict],
        answer: Callable[[int, Message, Message], Message] | None = None,
    ) -> None:
        self.nodes, self.answer = nodes, answer
        self._run = None
        client.no_startup()  # the clients share this process

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        raise NotImplementedError("in-process: use send_and_receive")

    def pull_messages(self, message_ids):
        raise NotImplementedError("in-process: use send_and_receive")

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            context = Context(RUN_ID, node, self.nodes[node], RecordDict(), {})
            reply = client_app.app(msg, context)
            if self.answer is not None:
                reply = self.answer(node, msg, reply)
            replies.append(reply)
        return replies

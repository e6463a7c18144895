"""The consortium's parties as Flower's grid, in this process: a message to a
node is that party's round (or its evaluation), run in node order, so that a
SplitFed run is the same every time; a party at fault is dropped from the
round by name, the consortium goes on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from flwr.app import (
    ArrayRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import ErrorCode

from aisyn.fl.records import record_to_tensors, tensors_to_record
from aisyn.link.errors import LinkError
from aisyn.splitfed.member import Member


@contextlib.contextmanager
def flower_task(run_id: int) -> Iterator[None]:
    """Flower stamps each message with the identity of the task that runs
    it, which its runtime sets; in this process this driver is that runtime
    (the server's node, 0). Put back as it was afterwards."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 0, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class MembersGrid:
    """Flower's grid (the two calls ``Strategy.start`` makes of it) over the
    consortium's parties in this process: a message to a node is that
    party's round, run in node order -- B takes the parties' steps one after
    another, so the run is the same every time."""

    def __init__(self, members: Mapping[int, Member]) -> None:
        self.members = dict(members)

    def get_node_ids(self) -> list[int]:
        return list(self.members)

    def send_and_receive(self, messages, *, timeout: float | None = None):
        del timeout  # in-process: a party that fails raises
        out = []
        for msg in sorted(messages, key=lambda m: m.metadata.dst_node_id):
            member = self.members[msg.metadata.dst_node_id]
            server_round = int(msg.content.config_records["config"]["server-round"])
            if member.dropped is None:
                try:
                    out.append(Message(_run(member, msg), reply_to=msg))
                    continue
                except DROPS as e:  # the party's failure, not the consortium's
                    member.drop(
                        f"party {member.name} dropped in round {server_round}: {e}"
                    )
            # an error reply: the guard rejects it in one line naming the party
            error = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, member.dropped)
            out.append(Message(error, reply_to=msg))
        return out


#: what a party's round fails with when the party, not the consortium, is at
#: fault: a step skipped for its non-finite tensors (``SkippedStep``), B's
#: non-finite answer to them, or its session ended by B (a link error that
#: carries B's reason)
DROPS = (FloatingPointError, LinkError)


def _run(member: Member, msg: Message) -> RecordDict:
    """``member``'s reply to ``msg``: its round, or its evaluation."""
    arrays = msg.content.array_records["arrays"]
    config = msg.content.config_records["config"]
    member.load_global(_global_of(member, arrays))
    if msg.metadata.message_type == MessageType.TRAIN:
        metrics = member.train_round(int(config["server-round"]), _proximal_mu(config))
        return RecordDict(
            {
                "arrays": tensors_to_record(member.segments()),
                "metrics": MetricRecord(metrics),
            }
        )
    loss = member.valid_loss()
    return RecordDict(
        {"metrics": MetricRecord({"num-examples": member.examples, "valid-loss": loss})}
    )


def _proximal_mu(config) -> float:
    """FedProx's mu, for FedProx only (every round's config carries the
    setting, as it does to a federated client)."""
    if config.get("strategy") != "fedprox":
        return 0.0
    return float(config["proximal-mu"])


def _global_of(member: Member, arrays: ArrayRecord) -> dict:
    try:
        return record_to_tensors(arrays, member.spec)
    except ValueError as e:
        raise ValueError(f"party {member.name}: bad global segments: {e}") from None

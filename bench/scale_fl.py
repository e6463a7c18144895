"""Federated client on 2 ranks vs 1: the global model after one chunked round.

One client, one round of full fine-tuning of a small PanGu-alpha (vocab 8000,
hidden 32, 3 layers: 1.1 MB of fp32 weights) on news cloze items, the global
model and the update travelling in chunks under a 256 KiB message limit. The
round runs twice, identically but for the client's ranks: its local steps on
one process, then on 2 DDP ranks (torchrun, gloo on 127.0.0.1; each rank
half of every batch). Prints the max |difference| of the two global models.

The round is the real code on both sides -- the server's ``ChunkedGrid`` and
guarded FedAvg (``aisyn.fl.chunks``, ``aisyn.fl.strategy``), the client's
chunk handlers and ``fl.client.client_train`` with its ranks (``aisyn.fl.ranks``)
-- over an in-process grid that hands each message to the client's handler,
not Flower's SuperLink and SuperNodes: every Flower message costs a fresh
ClientApp process (seconds each), which would make this a 10-minute bench
measuring process start-up. ``tests/fl/test_chunked_simulate.py`` runs
chunked rounds through Flower's runtime.

    python bench/scale_fl.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
from flwr.app import Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType

from aisyn.data.tokenizer import PanguTokenizer
from aisyn.fl import chunked_grid, chunks
from aisyn.fl.client import ClientNode, client_train
from aisyn.fl.records import tensors_to_record
from aisyn.fl.round_message import round_config
from aisyn.fl.settings import FLSettings
from aisyn.fl.strategy import guard_of, make_strategy
from aisyn.model.families import build_model
from aisyn.model.pangu import PanguConfig
from aisyn.testbed.inputs import cached_sft
from aisyn.testbed.presets import Preset
from aisyn.train import checkpoint as ckpt
from aisyn.train.lora import apply_method, trainable_tensors
from aisyn.train.models import describe_base, load_base
from aisyn.train.run import RunDir

MODEL = dict(
    vocab_size=8000, hidden_size=32, num_layers=3, num_heads=4, ffn_size=64, seq_len=64
)
LIMIT_KIB = 256
RUN_ID = 1


class InProcessGrid:
    """Hands each message to the one client's handler, as its SuperNode would."""

    def __init__(self, node_id: int, handle) -> None:
        self.node_id, self.handle = node_id, handle

    def get_node_ids(self):
        return [self.node_id]

    def send_and_receive(self, messages, *, timeout=None):
        return [self.handle(m) for m in messages]


def client_handler(node: ClientNode):
    """The ClientApp's handlers (``aisyn.fl.client_app``), in-process."""

    def handle(m: Message) -> Message:
        kind = m.metadata.message_type
        if kind == chunks.GLOBAL_CHUNK:
            chunks.stage_global(node.out, RUN_ID, m.content)
            return Message(RecordDict({"metrics": MetricRecord({"ok": 1})}), reply_to=m)
        if kind == chunks.UPDATE_CHUNK:
            config = m.content.config_records[chunks.CHUNK_META]
            return Message(chunks.update_chunk(node.out, RUN_ID, config), reply_to=m)
        assert kind == MessageType.TRAIN, kind
        _, metrics = client_train(node, m.content["config"], None, RUN_ID)
        return Message(RecordDict({"metrics": metrics}), reply_to=m)

    return handle


def one_round(base: Path, data: Path, out: Path, ranks: int, settings: FLSettings):
    """The global model after one chunked round of one client on ``ranks``."""
    info = describe_base(base)
    model, _ = load_base(info, "cpu")
    trainable = apply_method(model, settings.method_spec(), settings.train.seed)
    initial = trainable_tensors(trainable)
    spec = {n: tuple(p.shape) for n, p in trainable}
    plan = chunks.plan_for(settings, spec)
    strategy = make_strategy(settings)
    guard = guard_of(strategy)
    node = ClientNode("news", data, base, out / f"client-{ranks}", ranks)
    grid = chunked_grid.ChunkedGrid(
        InProcessGrid(1, client_handler(node)),
        spec,
        plan,
        chunks.limit_bytes(settings.max_message_mb),
        out / f"spill-{ranks}",
    )
    guard.chunked = grid
    config = round_config(settings, info)
    messages = strategy.configure_train(1, tensors_to_record(initial), config, grid)
    replies = grid.send_and_receive(messages, timeout=settings.round_timeout)
    arrays, _ = strategy.aggregate_train(1, replies)
    entry = guard.round_log[1]
    if arrays is None or entry["accepted"] != 1:
        raise RuntimeError(f"the round failed: {entry}")
    return {k: a.numpy() for k, a in arrays.items()}, len(plan)


def make_base(path: Path, tok: PanguTokenizer) -> Path:
    run = RunDir(path)
    cfg = PanguConfig(**MODEL)
    run.create(
        {"kind": "train", "model": cfg.to_dict(), "tokenizer": tok.info()}, resume=False
    )
    run.copy_tokenizer(tok.path)
    model = build_model(cfg, seed=0)
    ckpt.save(run.checkpoints, 0, {ckpt.MODEL_FILE: ckpt.unique_state_dict(model)}, {})
    return path


def two_rank_client_line() -> str:
    from flwr.supercore.task_identity import TaskIdentity

    # Flower stamps messages with the running task's identity (the ServerApp's)
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, 0, 1
    try:
        return _line()
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def _line() -> str:
    tok = PanguTokenizer.load()
    data = cached_sft(
        "news",
        tok,
        Preset(
            name="scale-fl",
            seq_len=MODEL["seq_len"],
            max_documents=300,
            per_document=2,
            test_per_document=1,
        ),
    )
    settings = FLSettings.from_dict(
        dict(
            rounds=1,
            local_steps=3,
            batch_size=4,
            lr=1e-4,
            warmup=1,
            eval_items=8,
            min_clients=1,
            round_timeout=300,
            max_message_mb=LIMIT_KIB / 1024,
        )
    )
    with tempfile.TemporaryDirectory(prefix="scale-fl-") as tmp:
        out = Path(tmp)
        base = make_base(out / "base", tok)
        one, n_chunks = one_round(base, data, out, 1, settings)
        two, _ = one_round(base, data, out, 2, settings)
    diff = max(float(np.abs(one[k] - two[k]).max()) for k in one)
    return (
        f"fl client 2 ranks vs 1: max |diff| {diff:.2g} over 1 round of "
        f"{settings.local_steps} AdamW steps at lr {settings.train.lr:g} "
        f"(update in {n_chunks} chunks of <= {LIMIT_KIB} KiB)"
    )


if __name__ == "__main__":
    print(two_rank_client_line())
    sys.exit(0)

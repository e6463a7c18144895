"""The Flower ``ClientApp``: thin handlers around ``aisyn.fl.client``.

Each SuperNode runs this once per message, in a fresh process. The node's own
settings (its data, base model copy and run folder) come from the SuperNode's
``--node-config``; everything else from the server's ``ConfigRecord``.

Flower's mods wrap the handlers, each acting only on the messages it is for:
SecAgg+'s (``--secure-aggregation``: its key stages never reach the handlers,
so ``aisyn.fl.client`` and torch are imported only where they are needed) and
client-side DP clipping (``--dp client``); see ``aisyn.fl.secure``.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from aisyn.fl.runtime import app_logging
from aisyn.fl.secure import (
    legacy_fit_mod,
    maskable_update_mod,
    optional_fixedclipping_mod,
    optional_secaggplus_mod,
)

# Outermost first: SecAgg+ masks what the legacy adapter returns, which is the
# update after client-side DP clipping, once it is checked to be maskable
# (each mod acts only on its messages).
MODS = [
    optional_secaggplus_mod,
    maskable_update_mod,
    legacy_fit_mod,
    optional_fixedclipping_mod,
]
app = ClientApp(mods=MODS)


def _round(msg: Message, context: Context) -> tuple:
    """What ``client_train`` and ``client_evaluate`` take: this node (its
    ``--node-config``), the round's config, the global model (None: a chunked
    round, staged already) and the run."""
    from aisyn.fl.client import ClientNode

    return (
        ClientNode.from_node_config(dict(context.node_config)),
        msg.content["config"],
        msg.content.array_records.get("arrays"),
        msg.metadata.run_id,
    )


@app.train()
def train(msg: Message, context: Context) -> Message:
    app_logging()
    from aisyn.fl.client import client_train

    records, metrics = client_train(
        *_round(msg, context), control=msg.content.array_records.get("control")
    )  # (SCAFFOLD's control variate, where the strategy sends one)
    return Message(RecordDict({**records, "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    app_logging()
    from aisyn.fl.client import client_evaluate

    metrics = client_evaluate(*_round(msg, context))
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


# A chunked round (aisyn.fl.chunks): the global model arrives chunk by chunk
# before the train / evaluate message, the update leaves chunk by chunk after
# it. Neither handler imports torch or builds the model.


@app.query("global_chunk")
def global_chunk(msg: Message, context: Context) -> Message:
    from aisyn.fl import chunks

    out = Path(str(context.node_config["out"]))
    index = chunks.stage_global(out, msg.metadata.run_id, msg.content)
    return Message(
        RecordDict({"metrics": MetricRecord({"staged": index})}), reply_to=msg
    )


@app.query("update_chunk")
def update_chunk(msg: Message, context: Context) -> Message:
    from aisyn.fl import chunks

    out = Path(str(context.node_config["out"]))
    config = msg.content.config_records[chunks.CHUNK_META]
    return Message(chunks.update_chunk(out, msg.metadata.run_id, config), reply_to=msg)

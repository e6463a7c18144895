"""A federated server in its own process, for a test to kill:
``python federation_proc.py BASE OUT NAME=SFT_DIR ...`` runs the settings of
``test_federation_resume`` in process (``aisyn.fl.in_process``)."""

from __future__ import annotations

import sys
from pathlib import Path

from flwr.supercore.task_identity import TaskIdentity

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from test_federation_resume import nodes, settings  # noqa: E402

from aisyn.fl.in_process import RUN_ID, InProcessGrid  # noqa: E402
from aisyn.fl.server import ServerNode, run_server  # noqa: E402

if __name__ == "__main__":
    base, out = Path(sys.argv[1]), Path(sys.argv[2])
    sft = dict(arg.split("=", 1) for arg in sys.argv[3:])
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, 0, 1
    run_server(
        settings(),
        ServerNode(base, out / "server"),
        InProcessGrid(nodes(base, sft, out)),
    )

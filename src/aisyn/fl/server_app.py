"""The Flower ``ServerApp``: reads the run config, hands over to ``aisyn.fl.server``."""

from __future__ import annotations

import logging
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from aisyn.fl import server
from aisyn.fl.settings import FLSettings

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s")
    for noisy in ("matplotlib", "PIL", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    run_config = dict(context.run_config)
    settings = FLSettings.from_run_config(run_config)
    node = server.ServerNode(
        base=Path(run_config["base"]),
        out=Path(run_config["out"]),
        resume=bool(run_config.get("resume", False)),
    )
    server.run_server(settings, node, grid)

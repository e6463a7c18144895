"""The Flower ``ServerApp``: reads the run config, hands over to ``aisyn.fl.server``."""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from aisyn.fl import server
from aisyn.fl.runtime import app_logging
from aisyn.fl.settings import FLSettings

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    app_logging()
    run_config = dict(context.run_config)
    settings = FLSettings.from_run_config(run_config)
    node = server.ServerNode(
        base=Path(run_config["base"]),
        out=Path(run_config["out"]),
        resume=bool(run_config.get("resume", False)),
    )
    server.run_server(settings, node, grid)

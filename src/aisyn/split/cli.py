"""``aisyn split plan|train|serve|eval|generate|merge|status``: the commands,
each with its party (``split.planner.cli``, ``split.client.cli``,
``split.centre.cli``)."""

from __future__ import annotations

import argparse

from aisyn.flagtable import add_group
from aisyn.split.centre import cli as centre_cli
from aisyn.split.client import cli as client_cli
from aisyn.split.planner import cli as planner_cli


def register(sub: argparse._SubParsersAction) -> None:
    ssub = add_group(
        sub,
        "split",
        "split (pipeline) training across two parties",
        description="Cross-domain split training: the data party A keeps the "
        "embedding and the head (tokens, labels and the loss never leave it), the "
        "compute party B runs the middle blocks. See docs/split.md.",
    )
    # A command's --help description is its cmd_* function's docstring; the
    # order is --help's
    planner_cli.register(ssub)
    client_cli.register(ssub)
    centre_cli.register(ssub)

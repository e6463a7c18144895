"""The environment of every process the project starts.

Run from a virtualenv that is not activated (``/path/to/venv/bin/aisyn ...``, as
cron, systemd or pipx do), ``PATH`` does not hold the venv's ``bin`` folder, so a
child that starts a console script by name — Flower's SuperLink spawns
``flower-superexec``, SuperExec spawns ``flwr-serverapp`` / ``flwr-clientapp`` —
does not find it, or finds another installation's. Putting this interpreter's
own folder first makes every child see the same installation as the parent.

The folder is ``sys.executable``'s parent as written, not resolved: in a venv
``bin/python`` is a symlink to the base interpreter, whose folder has none of the
venv's scripts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path


def interpreter_bin() -> str:
    """The folder of this interpreter (a venv's ``bin``), where its scripts are."""
    return str(Path(sys.executable).parent)


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) plus ``extra``, with this
    interpreter's folder first on ``PATH``."""
    env = dict(os.environ if base is None else base)
    env.update(extra)
    here = interpreter_bin()
    rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != here]
    env["PATH"] = os.pathsep.join([here, *rest])
    return env

"""Flag defaults from a TOML file: ``--config scenario1`` and the like.

A ready configuration (``aisyn/configs/NAME.toml``, or any file) holds one
table per command, named by the command's words after ``aisyn`` (``[train]``,
``[split-train]``, ``[split-serve]``) with the command's flags as keys
(``batch-size = 16``). ``--config`` makes a table's values that command's
defaults: a flag given on the command line still wins, wherever it stands.
Every value goes through its flag's own type and choices, so a bad one
fails as the flag would, named by file, table and key.

The federated commands' ``--config`` (``fl.settings``) is another thing: a
federated run's settings, which also travel to the clients.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

CONFIG_FLAG = "--config"


def shipped_configs() -> list[str]:
    """Names of the configurations that ship in ``aisyn/configs``."""
    root = resources.files("aisyn") / "configs"
    return sorted(
        p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml")
    )


def config_path(name: str) -> Path:
    """The file ``--config NAME`` means: a path, else a shipped name."""
    path = Path(name)
    if path.is_file():
        return path
    if "/" not in name and not name.endswith(".toml"):
        asset = resources.files("aisyn") / "configs" / f"{name}.toml"
        if asset.is_file():
            return Path(str(asset))
        raise ValueError(
            f"--config {name}: no such file or shipped configuration "
            f"(shipped: {', '.join(shipped_configs())})"
        )
    raise FileNotFoundError(f"--config {name}: no such file")


def read_table(name: str, table: str) -> dict:
    """The ``[table]`` of configuration ``name`` ({} if it has none)."""
    path = config_path(name)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {name}: not valid TOML ({e})") from None
    values = data.get(table, {})
    if not isinstance(values, dict):
        raise ValueError(f"--config {name}: [{table}] is not a table")
    return values


def config_name(argv: Sequence[str]) -> str | None:
    """The value of ``--config`` in a command's arguments, if given."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == CONFIG_FLAG and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(CONFIG_FLAG + "="):
            return arg.split("=", 1)[1]
    return None


def apply_config(
    parser: argparse.ArgumentParser, table: str, argv: Sequence[str]
) -> None:
    """Make ``[table]`` of the ``--config`` in ``argv`` ``parser``'s defaults
    (a required flag the table sets is then no longer required)."""
    name = config_name(argv)
    if name is None:
        return
    where = f"--config {name} [{table}]"
    by_key = {
        a.option_strings[0].removeprefix("--"): a
        for a in parser._actions
        if a.option_strings and a.option_strings[0].startswith("--")
    }
    defaults = {}
    for key, value in read_table(name, table).items():
        action = by_key.get(key)
        if action is None or key == CONFIG_FLAG.removeprefix("--"):
            raise ValueError(f"{where}: {key!r} is not a flag of this command")
        defaults[action.dest] = _value(action, value, f"{where} {key}")
        action.required = False
    parser.set_defaults(**defaults)


def _value(action: argparse.Action, value, where: str):
    """``value`` as the flag would parse it, or ValueError naming ``where``."""
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: must be true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_one(action, item, where) for item in items]
    if isinstance(value, list | dict) or isinstance(value, bool):
        raise ValueError(f"{where}: must be a single value, got {value!r}")
    return _one(action, value, where)


def _one(action: argparse.Action, value, where: str):
    text = str(value)
    try:
        parsed = action.type(text) if action.type else text
    except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    if action.choices is not None and parsed not in action.choices:
        raise ValueError(
            f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}"
        )
    return parsed

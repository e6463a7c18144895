"""Command-line flags as tables, one row a flag, and the rows that several
commands share (``DEVICE``, ``QUIET``, ``model_flag``, ``init_from_flag``), so
that each such flag is defined once. Below every package with commands, so
that each command's parser imports it."""

from __future__ import annotations

import argparse
import inspect
import sys
from typing import Any, NamedTuple

from aisyn import validate
from aisyn.flagfile import CONFIG_FLAG, apply_config, config_path, shipped_configs

#: a row's default that makes its flag required
REQUIRED = object()


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, where it has one worth
    showing: not for a required flag, a switch (False) or an unset value
    (None, whose meaning the help text says), nor twice."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        default = action.default
        if (
            text is None
            or text == argparse.SUPPRESS
            or not action.option_strings
            or action.required
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or "%(default)" in text
        ):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """The parser of ``aisyn`` and of every subcommand under it (argparse makes
    subparsers of their parent's class): all show their defaults in ``--help``;
    one that ``add_config_flag`` gave a table takes its defaults from
    ``--config``."""

    #: the ``--config`` table of this command (None: no ``--config`` here)
    config_table: str | None = None

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if self.config_table is not None:
            argv = sys.argv[1:] if args is None else list(args)
            try:
                apply_config(self, self.config_table, argv)
            except (ValueError, OSError) as e:
                self.error(str(e))
        return super().parse_known_args(args, namespace)


def add_config_flag(parser: argparse.ArgumentParser, table: str) -> None:
    """``--config NAME``: this command's defaults from ``[table]`` of a TOML
    file or a shipped configuration (``flagfile``)."""
    parser.config_table = table
    names = ", ".join(n for n in shipped_configs() if table in _tables_of(n))
    parser.add_argument(
        CONFIG_FLAG,
        default=None,
        metavar="NAME",
        help=f"defaults from [{table}] of a TOML file or a shipped configuration "
        f"({names}); flags given still win",
    )


def _tables_of(name: str) -> set[str]:
    import tomllib

    return set(tomllib.loads(config_path(name).read_text(encoding="utf-8")))


def add_flags(container: argparse._ActionsContainer, *rows: tuple) -> None:
    """Add one option per row ``(flag, kind, default, help)``, in order.

    ``kind`` is the argparse type (None: a string), an action's name
    ("store_true", "append") or a list of choices. A default of ``REQUIRED``
    makes the flag required; None keeps argparse's own. A flag that needs more
    (nargs, metavar, ...) takes a plain ``add_argument``.
    """
    for flag, kind, default, help_text in rows:
        kwargs: dict[str, Any] = {"help": help_text}
        if isinstance(kind, str):
            kwargs["action"] = kind
        elif isinstance(kind, list):
            kwargs["choices"] = kind
        elif kind is not None:
            kwargs["type"] = kind
        if default is REQUIRED:
            kwargs["required"] = True
        elif default is not None:
            kwargs["default"] = default
        container.add_argument(flag, **kwargs)


def add_group(
    sub, name: str, help_text: str, *, description: str | None = None, metavar="ACTION"
) -> argparse._SubParsersAction:
    """Command ``name`` whose own subcommands go into what this returns
    (``aisyn split ACTION``)."""
    group = sub.add_parser(name, help=help_text, description=description)
    return group.add_subparsers(dest=f"{name}_command", required=True, metavar=metavar)


def add_command(sub, name: str, func, help_text: str) -> argparse.ArgumentParser:
    """Subcommand ``name``, which runs ``func(args)`` and shows ``func``'s
    docstring as its ``--help`` description."""
    p = sub.add_parser(name, help=help_text, description=inspect.getdoc(func))
    p.set_defaults(func=func)
    return p


# --- rows several commands share ------------------------------------------------


class Row(NamedTuple):
    """One ``add_flags`` row, by name where a command reads one of its parts."""

    flag: str
    kind: Any
    default: Any
    help: str


#: where a command runs its model
DEVICE = Row("--device", validate.device, "auto", "auto, cpu, cuda, cuda:1, ...")
#: for a command that shows a progress bar
QUIET = Row("--quiet", "store_true", None, "no progress bar")


def model_flag(default, *, trains: bool = True) -> Row:
    """``--model``, the model a command builds (``REQUIRED`` or a preset name);
    ``trains``: the command trains it (a Hugging Face folder's weights the start)."""
    return Row(
        "--model",
        None,
        default,
        "preset (tiny, small, 350M, 2.6B, 13B, 200B; gpt2-tiny, llama-tiny, "
        "qwen2-tiny), JSON file, or hf:DIR: a Hugging Face GPT-2/Llama/Qwen2 "
        "folder" + (", its pretrained weights the start" if trains else ""),
    )


def init_from_flag(more: str = "") -> Row:
    """``--init-from``, the base model a fresh run starts from; ``more``: what
    this command adds about it."""
    return Row(
        "--init-from",
        None,
        None,
        "start a fresh run from this base model (run folder, checkpoint or "
        f".safetensors) instead of random init{more}",
    )

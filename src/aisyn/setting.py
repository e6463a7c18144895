"""A setting: a dataclass field declared once -- its default, its range or
choices, and, where users set it, its flag and help text.

``TrainConfig``, ``DiLoCoConfig`` and ``SplitOptions`` declare their fields with
``setting``. From those declarations come the one range check of each field
(``check_fields``, run by each dataclass's ``__post_init__``: a config read from
a run folder, a TOML file or a peer's hello is held to the same bounds as a
flag), the command-line flags (``flag_rows``, argparse types made of the
bounds) and the dataclass of the parsed flags (``from_args``). A default or a
bound is changed in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from aisyn.validate import number_problem, number_type


def setting(
    default,
    flag: str | None = None,
    help: str = "",
    *,
    choices: Iterable[str] | None = None,
    check: bool = True,
    parse: Callable[[str], Any] | None = None,
    **bounds,
):
    """A dataclass field: its ``default``, its range (``number_problem``'s
    keywords; None stays allowed where it is the default) or its
    ``choices``, and, when users set it, its ``--flag`` and ``help``.
    ``check=False``: checked where it is used (a device name, say);
    ``parse``: the flag's own argparse type, where the bounds cannot say
    what it takes (a timeout's "none")."""
    return dataclasses.field(
        default=default,
        metadata={
            "flag": flag,
            "help": help,
            "bounds": bounds,
            "choices": tuple(choices) if choices is not None else None,
            "check": check,
            "parse": parse,
        },
    )


def _integer(f: dataclasses.Field) -> bool:
    return str(f.type).split(" | ")[0] == "int"


def problem(f: dataclasses.Field, value) -> str | None:
    """Why ``value`` does not fit field ``f`` ("must be >= 1, got 0"), or None."""
    meta = f.metadata
    if value is None and f.default is None or not meta.get("check", True):
        return None
    if isinstance(f.default, bool):
        return (
            None if isinstance(value, bool) else f"must be true or false, not {value!r}"
        )
    if meta.get("choices"):
        ok = value in meta["choices"]
        return (
            None
            if ok
            else f"must be one of {', '.join(meta['choices'])}, got {value!r}"
        )
    if not meta.get("bounds"):
        return None
    if _integer(f) and (isinstance(value, bool) or not isinstance(value, int)):
        return f"must be an integer, got {value!r}"
    return number_problem(value, **meta["bounds"])


def shown_as_flag(f: dataclasses.Field) -> str:
    """How a message names field ``f``: its flag, else its name."""
    return f.metadata.get("flag") or f.name


def check_fields(obj, shown: Callable[[dataclasses.Field], str] = shown_as_flag):
    """ValueError ``"<shown> must be ..."`` for the first field of dataclass
    ``obj`` whose value does not fit its declaration."""
    for f in dataclasses.fields(obj):
        if "flag" in f.metadata and (why := problem(f, getattr(obj, f.name))):
            raise ValueError(f"{shown(f)} {why}")


def flag_type(f: dataclasses.Field) -> Any:
    """The argparse type (or action, or choices) of field ``f``'s flag."""
    if f.metadata.get("parse") is not None:
        return f.metadata["parse"]
    if isinstance(f.default, bool):
        return "store_true"
    if f.metadata["choices"]:
        return list(f.metadata["choices"])
    bounds = f.metadata["bounds"]
    if not bounds:
        return None  # a string, checked where it is used
    return number_type(int if _integer(f) else float, f.name, **bounds)


def flagged(cls) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` that users set with a flag."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag")]


def flag_rows(cls, **defaults) -> list[tuple]:
    """``add_flags`` rows (flag, kind, default, help) of ``cls``'s flagged
    fields, in declaration order; ``defaults``: a command's own, by field."""
    rows = []
    for f in flagged(cls):
        default = defaults.get(f.name, f.default)
        rows.append(
            (
                f.metadata["flag"],
                flag_type(f),
                None if default is False else default,
                f.metadata["help"],
            )
        )
    return rows


def arg_name(f: dataclasses.Field) -> str:
    """The attribute argparse stores field ``f``'s flag as."""
    return f.metadata["flag"][2:].replace("-", "_")


def from_args(cls, args, **extra):
    """An instance of ``cls`` from its flags parsed into ``args``; ``extra``:
    the fields the command sets otherwise."""
    return cls(**{f.name: getattr(args, arg_name(f)) for f in flagged(cls)}, **extra)

"""Every command's --seed takes the same range, and says so naming the flag
(a seed past 2**64 - 1 used to end in torch's "Overflow when unpacking long
long")."""

from __future__ import annotations

import argparse

import pytest

from aisyn.cli import build_parser, main
from aisyn.validate import MAX_SEED


def _commands_with_seed(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.Action]]:
    found = []
    for action in parser._actions:
        if "--seed" in action.option_strings:
            found.append((path, action))
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands_with_seed(sub, (*path, name))
    return found


COMMANDS = _commands_with_seed(build_parser())


def test_the_seed_commands_are_found():
    paths = {p for p, _ in COMMANDS}
    for want in (
        ("train",),
        ("split", "train"),
        ("generate",),
        ("split", "generate"),
        ("privacy", "audit"),
        ("privacy", "calibrate"),
        ("fl", "partition"),
    ):
        assert want in paths
    assert len(paths) >= 10


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=" ".join)
def test_a_seed_past_the_range_is_one_line_naming_the_flag(path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*path, "--seed", str(2**64)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --seed: must be <= 9223372036854775807, got " in err, err
    assert "18446744073709551616" in err and "Overflow" not in err


@pytest.mark.parametrize(
    "action", [a for _, a in COMMANDS], ids=[" ".join(p) for p, _ in COMMANDS]
)
def test_the_whole_range_is_taken(action):
    assert action.type(str(MAX_SEED)) == MAX_SEED
    assert action.type("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 0"):
        action.type("-1")


def test_the_largest_seed_and_the_offsets_added_to_it_still_seed_torch():
    """The code adds small offsets to a seed (the epoch, +1): from MAX_SEED
    they stay within what torch takes; past 2**64 - 1 it overflows."""
    import torch

    torch.Generator().manual_seed(MAX_SEED + 10**6)
    with pytest.raises((ValueError, RuntimeError)):
        torch.Generator().manual_seed(2**64)


def test_a_seed_from_a_file_is_held_to_the_same_range():
    from aisyn.fl.settings import FLSettings
    from aisyn.train.config import TrainConfig

    with pytest.raises(ValueError, match="seed must be <= 9223372036854775807"):
        TrainConfig(seed=2**64)
    assert TrainConfig(seed=MAX_SEED).seed == MAX_SEED
    with pytest.raises(ValueError, match="seed must be <= 9223372036854775807"):
        FLSettings.from_dict({"seed": 2**64}, "test.toml")

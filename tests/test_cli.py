import argparse
import json
import subprocess
import sys

import pytest

from aisyn.cli import build_parser, main


def _subcommands(parser, prefix=()):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from _subcommands(sub, (*prefix, name))


@pytest.mark.parametrize(
    "argv", [(), *_subcommands(build_parser())], ids=lambda a: " ".join(a) or "aisyn"
)
def test_every_subcommand_has_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])

    assert e.value.code == 0
    assert "usage: aisyn" in capsys.readouterr().out


def _parsers(parser, prefix=("aisyn",)):
    yield " ".join(prefix), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*prefix, name))


def test_every_flag_of_every_command_has_help_text():
    missing = [
        f"{command} {action.option_strings[-1]}"
        for command, parser in _parsers(build_parser())
        for action in parser._actions
        if action.option_strings
        and action.help != argparse.SUPPRESS  # hidden old spellings
        and not (action.help or "").strip()
    ]

    assert missing == []


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # unwrap argparse's lines

    assert "optimizer steps (default: 200)" in out
    assert "peak learning rate (default: 0.001)" in out
    assert "--resume [auto] continue the run" in out  # no "(default: False)"
    assert "(default: False)" not in out and "(default: None)" not in out


@pytest.mark.heavy
def test_prepare_train_eval_end_to_end(tmp_path, capsys, model_file):
    model = model_file
    data, run = tmp_path / "data", tmp_path / "run"

    assert (
        main(
            [
                "prepare",
                "--corpus",
                "news",
                "--out",
                str(data),
                "--seq-len",
                "32",
                "--max-docs",
                "800",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                "--model",
                str(model),
                "--data",
                str(data),
                "--out",
                str(run),
                "--steps",
                "4",
                "--batch-size",
                "2",
                "--quiet",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "eval",
                "--run",
                str(run),
                "--data",
                str(data),
                "--per-doc",
                "1",
                "--max-items",
                "20",
            ]
        )
        == 0
    )

    out = capsys.readouterr().out
    assert "final loss" in out and "cloze accuracy" in out
    result = json.loads((run / "eval.json").read_text())
    assert result["cloze"]["items"] == 20
    assert result["test"]["loss"] > 0


def test_user_errors_are_one_line(tmp_path, capsys):
    code = main(
        [
            "train",
            "--data",
            str(tmp_path / "missing"),
            "--out",
            str(tmp_path / "r"),
            "--steps",
            "1",
        ]
    )

    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0
    assert err.startswith("aisyn: error:") and "missing" in err


@pytest.mark.heavy
def test_console_script_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "aisyn.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == 0 and "demo" in proc.stdout

"""How a split session starts and ends, as a user sees it (issue 17): a
normal end logs a normal end; a refused or failed start leaves no run folder
behind on either party, so the retry is not told "already holds a run"."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

from conftest import CUT
from test_server_hardening import fresh_hello

from aisyn.model.segments import parse_partition
from aisyn.split.session import open_local


def test_a_normal_end_logs_a_normal_end(tmp_path, split_config, caplog):
    caplog.set_level(logging.INFO, logger="aisyn")
    partition = parse_partition(CUT, split_config)
    with open_local(
        split_config,
        partition,
        tmp_path / "b",
        fresh_hello(split_config),
        codec="none",
        device="cpu",
    ) as opened:
        opened.link.close()  # A is done: BYE between rounds
        opened.thread.join(30)
    assert not opened.errors
    assert "the data party closed it after 0 round(s)" in caplog.text
    assert "never arrived" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
    ]


# --- the docs' command lines, as written -----------------------------------------

DOCS = Path(__file__).parents[2] / "docs"


def docs_command(doc: str, starts: str) -> list[str]:
    """The shell command in ``docs/doc`` that starts with ``starts`` (with its
    continuation lines), as argv after ``aisyn``."""
    lines = (DOCS / doc).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if line.startswith(starts):
            text = line
            while text.endswith("\\"):
                i += 1
                text = text[:-1] + lines[i]
            return shlex.split(text.split("#")[0])[1:]
    raise AssertionError(f"no command starting {starts!r} in docs/{doc}")


def with_values(argv: list[str], **values: str) -> list[str]:
    """``argv`` with flag values replaced (``out="..."`` sets ``--out``)."""
    argv = list(argv)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        argv[argv.index(flag) + 1] = value
    return argv


def test_the_quick_start_pipeline_line_pipelines():
    from aisyn.cli import build_parser
    from aisyn.split.train import check_pipeline
    from aisyn.train.flags import train_config_from_args

    argv = docs_command("split.md", "aisyn split train --mode grpc --spawn-backbone")
    args = build_parser().parse_args(argv)
    args.seed = 1  # cmd_train draws a secret one
    assert args.pipeline == 2
    cfg = train_config_from_args(args)
    assert cfg.grad_accum >= 2
    check_pipeline(args.pipeline, cfg)  # does not refuse


def test_pipeline_with_one_micro_batch_is_refused_in_one_line(
    tmp_path, news_data, capsys
):
    from aisyn.cli import main

    out = tmp_path / "run"
    argv = ["split", "train", "--mode", "local", "--data", str(news_data)]
    rc = main([*argv, "--out", str(out), "--steps", "2", "--pipeline", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("aisyn: error: --pipeline 2"), err
    assert "--micro-batch-size to a divisor of 8 below it, e.g. 4" in err[0]
    assert not out.exists()  # refused before anything was written

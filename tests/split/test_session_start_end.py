"""How a split session starts and ends, as a user sees it (issue 17): a
normal end logs a normal end; a refused or failed start leaves no run folder
behind on either party, so the retry is not told "already holds a run"."""

from __future__ import annotations

import logging

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

"""Fixtures for the link tests: dev certificates, a server, a hang watchdog."""

from __future__ import annotations

import faulthandler
from collections.abc import Iterator

import pytest
from linkutil import FAST, TOKEN

from aisyn.link import DevCerts, GrpcLinkServer, make_dev_certs


@pytest.fixture(autouse=True)
def _watchdog() -> Iterator[None]:
    """Dump all stacks and exit if a test hangs, so the suite always ends."""
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> DevCerts:
    return make_dev_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def server() -> Iterator[GrpcLinkServer]:
    with GrpcLinkServer("127.0.0.1:0", token=TOKEN, insecure=True, options=FAST) as srv:
        yield srv

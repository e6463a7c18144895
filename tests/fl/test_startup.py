"""A client's start-up cost is its process's age at its first round only."""

from aisyn.fl import client
from aisyn.fl.in_process import InProcessGrid


def test_a_process_counts_its_start_up_once(monkeypatch):
    monkeypatch.setattr(client, "_started", False)
    monkeypatch.setattr(client, "process_age_s", lambda: 4.5)
    assert client.startup_s() == 4.5
    # a long-lived process's later rounds started nothing: not its age again
    assert client.startup_s() == 0.0


def test_in_process_clients_start_nothing(monkeypatch):
    monkeypatch.setattr(client, "_started", False)
    monkeypatch.setattr(client, "process_age_s", lambda: 5189.0)
    InProcessGrid({})
    assert client.startup_s() == 0.0

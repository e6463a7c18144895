"""What a federated round's message carries, for the client (``fl.client``)
and the server (``fl.server``): the settings and base of the run, the round.

The Flower handlers in ``client_app.py`` / ``server_app.py`` only unpack
messages and call ``fl.client`` / ``fl.server``, so everything can be tested
without Flower's runtime.
"""

from __future__ import annotations

from flwr.app import ConfigRecord

from aisyn.fl.settings import FLSettings
from aisyn.train.models import BaseModel

RESULT_FILE = "result.json"


def round_config(settings: FLSettings, base: BaseModel) -> ConfigRecord:
    """What the server tells clients each round (Flower adds ``server-round``)."""
    return ConfigRecord(
        {
            **settings.to_run_config(),
            "base-fingerprint": base.fingerprint,
        }
    )


def settings_from_record(config: ConfigRecord) -> tuple[FLSettings, str, int]:
    d = dict(config)
    fingerprint = str(d.pop("base-fingerprint", ""))
    server_round = int(d.pop("server-round", 0))
    return FLSettings.from_run_config(d), fingerprint, server_round


def setting_differences(saved, now: dict) -> list[str]:
    """The names of the settings ``saved`` (a run folder's record) and ``now``
    disagree on, sorted. A setting the record lacks counts at its default:
    a later version added it, and its default is what the record's did."""
    if isinstance(saved, dict):
        saved = {k: v for k, v in FLSettings().to_dict().items() if k in now} | saved
    else:
        saved = {}
    return sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))

"""The robustness settings: aggregation, its parameters, and the update bounds."""

from __future__ import annotations

import pytest

from aisyn.fl.settings import FLSettings, load_settings


def test_robustness_settings_load_from_toml(tmp_path):
    path = tmp_path / "robust.toml"
    path.write_text(
        "[federated]\n"
        'aggregation = "trimmed-mean"\n'
        "trim-fraction = 0.25\n"
        "min-clients = 4\n"
        "max-examples = 5000\n"
        "max-norm-ratio = 4\n"
        "max-examples-ratio = 10\n"
    )
    s = load_settings(path)
    assert (s.aggregation, s.trim_fraction, s.min_clients) == ("trimmed-mean", 0.25, 4)
    assert (s.max_examples, s.max_norm_ratio, s.max_examples_ratio) == (5000, 4, 10)


def test_defaults_keep_fedavgs_mean_with_the_bounds_on():
    s = FLSettings()
    assert s.aggregation == "mean" and s.max_norm_ratio == 3.0 and s.max_examples == 0
    assert s.max_examples_ratio == 4.0


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"aggregation": "average"}, "unknown aggregation 'average'"),
        ({"aggregation": "krum", "min_clients": 4}, "needs min-clients >= 5, got 4"),
        ({"aggregation": "bulyan", "min_clients": 5}, "needs min-clients >= 7"),
        (
            {"aggregation": "krum", "assumed_attackers": 2, "min_clients": 5},
            "needs min-clients >= 7",
        ),
        ({"aggregation": "median", "strategy": "fedadam"}, "use it with strategy"),
        ({"aggregation": "trimmed-mean", "min_clients": 2}, "trims nothing"),
        ({"trim_fraction": 0.5}, "trim-fraction must be in [0, 0.5)"),
        ({"assumed_attackers": -1}, "assumed-attackers must be >= 0"),
        ({"max_examples": -5}, "max-examples must be >= 0"),
        ({"max_norm_ratio": 0.5}, "max-norm-ratio must be 0 (off) or >= 1"),
        ({"max_examples_ratio": 0.5}, "max-examples-ratio must be 0 (off) or >= 1"),
        ({"max_examples_ratio": -1.0}, "max-examples-ratio must be 0 (off) or >= 1"),
    ],
)
def test_bad_robustness_settings_are_refused_in_one_line(kw, message):
    with pytest.raises(ValueError) as e:
        FLSettings(**kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_aggregation_flag_is_offered_with_its_choices():
    import argparse

    from aisyn.fl.cli import add_settings_args

    p = argparse.ArgumentParser()
    add_settings_args(p)
    flags = ["--aggregation", "median", "--max-norm-ratio", "5"]
    args = p.parse_args([*flags, "--max-examples-ratio", "8"])
    assert args.aggregation == "median" and args.max_norm_ratio == 5.0
    assert args.max_examples_ratio == 8.0
    with pytest.raises(SystemExit):
        p.parse_args(["--aggregation", "average"])


def test_simulate_counts_its_clients_before_checking_the_aggregation(monkeypatch):
    """`--aggregation krum` with five --client and no --min-clients is valid."""
    import argparse

    import aisyn.fl.launch
    from aisyn.fl import cli

    seen = {}

    def fake_simulate(base, clients, out, settings, echo=False, **kw):
        seen["settings"] = settings
        return {"history": [], "run": str(out), "clients": {}}

    monkeypatch.setattr(aisyn.fl.launch, "simulate", fake_simulate)
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    clients = [f"--client=c{i}=sft{i}" for i in range(5)]
    args = parser.parse_args(
        ["fl", "simulate", "--base", "b", "--out", "o", "--aggregation", "krum"]
        + clients
    )
    args.func(args)
    assert seen["settings"].min_clients == 5
    assert seen["settings"].aggregation == "krum"
